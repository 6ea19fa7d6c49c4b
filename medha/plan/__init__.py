"""`medha plan`: the cheapest deployment that meets a trace's SLOs, searched in the simulator.

space.py says what may vary and checks it; slo.py what must hold; cost.py what a GPU-hour
costs; search.py runs the simulations (one process, a process pool, or Ray) and prunes what
it can prove; report.py turns the results into the Pareto front, the answer and the plots;
planner.py runs one plan through them, from the grid's chains to the files `medha plan` writes.
"""

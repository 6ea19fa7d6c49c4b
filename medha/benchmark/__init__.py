"""`medha bench`: an open-loop load generator for any OpenAI-compatible server.

Requests leave at their scheduled arrival times whatever the server is doing (open loop), each
one streams, and every text chunk is timestamped on arrival: TTFT, each TBT, TPOT and E2E are
the client's view, network and queueing included.
"""

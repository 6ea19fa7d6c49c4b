"""The engine's thread count follows the cores other processes leave free."""

from medha.engine.cpu_threads import ThreadGovernor, machine_busy_s


class Machine:
    """A fake clock, /proc/stat and process_time: `run(seconds, ours, others)` advances them as
    if this process kept `ours` cores busy and other processes `others`."""

    def __init__(self) -> None:
        self.t = self.machine = self.own = 0.0

    def run(self, seconds: float, ours: float, others: float) -> None:
        self.t += seconds
        self.own += ours * seconds
        self.machine += (ours + others) * seconds


def governor(m: Machine, max_threads=2, cores=2):
    calls = []
    g = ThreadGovernor(
        max_threads, cores, 1.0, lambda: m.machine, lambda: m.own, lambda: m.t, calls.append
    )
    return g, calls


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back():
    m = Machine()
    g, calls = governor(m)
    m.run(2.0, ours=2.0, others=0.05)  # idle machine: both cores ours
    assert g.tick() == 2 and calls == []
    m.run(2.0, ours=1.33, others=0.67)  # a spinning process shares a core with us
    assert g.tick() == 1 and calls == [1]
    m.run(2.0, ours=1.0, others=1.0)  # it keeps its core
    assert g.tick() == 1 and calls == [1]
    m.run(2.0, ours=1.0, others=0.0)  # it left
    assert g.tick() == 2 and calls == [1, 2]


def test_each_change_is_said_once(caplog):
    """A step log's slower steps are then told from a slower kernel (docs/vllm.md, run 5)."""
    m = Machine()
    g, _ = governor(m)
    with caplog.at_level("INFO", logger="medha.engine"):
        m.run(2.0, ours=2.0, others=0.05)
        g.tick()
        m.run(2.0, ours=1.33, others=0.67)
        g.tick()
        m.run(2.0, ours=1.0, others=1.0)
        g.tick()
        m.run(2.0, ours=1.0, others=0.0)
        g.tick()
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "CPU threads 2 -> 1: other processes kept 0.67 cores busy",
        "CPU threads 1 -> 2: other processes kept 0.00 cores busy",
    ]


def test_it_looks_once_per_interval():
    m = Machine()
    g, calls = governor(m)
    m.run(0.5, ours=1.0, others=1.0)
    assert g.tick() == 2  # half an interval: not measured yet
    m.run(0.6, ours=1.0, others=1.0)
    assert g.tick() == 1  # the whole 1.1 s counted


def test_never_above_its_own_count_nor_below_one():
    m = Machine()
    g, calls = governor(m, max_threads=4, cores=8)
    m.run(1.0, ours=4.0, others=3.0)  # 5 cores free: still 4
    assert g.tick() == 4 and calls == []
    m.run(1.0, ours=1.0, others=7.5)
    assert g.tick() == 1


def test_a_count_changed_behind_its_back_is_set_again():
    """Another engine, a worker group or a test harness may set the process's thread count: the
    governor fits the count the process has, not the one it set last."""
    m, process = Machine(), {"threads": 2}
    calls = []

    def set_threads(n):
        calls.append(n)
        process["threads"] = n

    g = ThreadGovernor(
        2,
        2,
        1.0,
        lambda: m.machine,
        lambda: m.own,
        lambda: m.t,
        set_threads,
        lambda: process["threads"],
    )
    m.run(2.0, ours=1.33, others=0.67)
    assert g.tick() == 1 and calls == [1]
    process["threads"] = 2  # set by someone else
    m.run(2.0, ours=1.0, others=1.0)  # the neighbour still busy: one thread is the fit
    assert g.tick() == 1 and calls == [1, 1] and process["threads"] == 1


def test_unmeasurable_machine_keeps_the_count():
    m = Machine()
    calls = []
    g = ThreadGovernor(2, 2, 1.0, lambda: None, lambda: m.own, lambda: m.t, calls.append)
    m.run(5.0, ours=1.0, others=1.0)
    assert g.tick() == 2 and calls == []


def test_proc_stat_parsing(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 1000 30 5 5 10 0 0\ncpu0 50 0 25 500 15 2 3 5 0 0\n")
    import os

    assert machine_busy_s(str(stat)) == 170 / os.sysconf("SC_CLK_TCK")
    assert machine_busy_s(str(tmp_path / "missing")) is None
    stat.write_text("intr 1 2 3\n")
    assert machine_busy_s(str(stat)) is None

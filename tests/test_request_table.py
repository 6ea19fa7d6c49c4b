"""One owner for a request's life: only the request table writes a Request's state and progress,
and packers only size chunks (they never reach the KV arbiter). Read from the source's AST, so
that a new module that writes a request, or a packer that allocates, fails here."""

import ast
import dataclasses
from pathlib import Path

import pytest

import medha
from medha.core.request import Request

ROOT = Path(medha.__file__).parent
TABLE = ROOT / "scheduler" / "request_table.py"
REQUEST = ROOT / "core" / "request.py"
PACKERS = ROOT / "scheduler" / "packers"

# A request's state and progress: every field the constructor does not take, except the memo of
# its prompt's page keys (a pure function of the prompt, computed once where first needed).
FIELDS = {f.name for f in dataclasses.fields(Request) if not f.init} - {"page_keys"}
# list fields a writer would change in place
MUTATED_LISTS = {"output_token_ids", "token_times_s"}
LIST_METHODS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}


def writes(path: Path, own: bool = False) -> list[str]:
    """Where `path` assigns a state or progress field of anything, calls `transition`, or
    changes one of a request's lists in place. `own`: an object's own fields (self.x) count
    too, as they do in the Request class itself."""
    return [f"{path.name}:{line} {what}" for line, what in write_sites(path, own)]


def write_sites(path: Path, own: bool = False) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for leaf in _assigned(targets):
            # (an object's own attribute of the same name, self.x, is not a request's)
            if leaf.attr in FIELDS and (own or not _is_self(leaf.value)):
                found.append((leaf.lineno, f"assigns .{leaf.attr}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "transition":
                found.append((node.lineno, "calls .transition"))
            if (
                f.attr in LIST_METHODS
                and isinstance(f.value, ast.Attribute)
                and f.value.attr in MUTATED_LISTS
            ):
                found.append((node.lineno, f"changes .{f.value.attr}"))
    return found


def enclosing_function(tree: ast.AST, line: int) -> str:
    """The name of the innermost function around `line` (<module> outside any)."""
    around = [
        fn
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        and fn.lineno <= line <= fn.end_lineno
    ]
    return max(around, key=lambda fn: fn.lineno).name if around else "<module>"


def _assigned(targets) -> list[ast.Attribute]:
    """The attributes an assignment writes: `a.x = `, `a.x, b.y = `, `(a.x, [b.y]) = `."""
    out = []
    for t in targets:
        if isinstance(t, ast.Attribute):
            out.append(t)
        elif isinstance(t, (ast.Tuple, ast.List)):
            out += _assigned(t.elts)
        elif isinstance(t, ast.Starred):
            out += _assigned([t.value])
    return out


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p not in (TABLE, REQUEST))


def test_the_fields_are_the_requests_state_and_progress():
    assert {"state", "num_computed", "num_scheduled", "num_inflight_batches"} <= FIELDS
    assert {"remaining_work_s", "deadline_s", "num_cached_tokens", "finish_reason"} <= FIELDS
    assert "prompt_len" not in FIELDS and "kv_capacity" not in FIELDS  # input; derived


def test_only_the_request_table_writes_a_requests_state_and_progress():
    assert writes(TABLE), "the check finds nothing to find: is it still reading the table?"
    found = [w for p in modules() for w in writes(p)]
    assert found == []


def request_writers(path: Path = REQUEST) -> dict[str, list[str]]:
    """function name -> what it writes of a request (its own fields included) in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    owners = {}
    for line, what in write_sites(path, own=True):
        owners.setdefault(enclosing_function(tree, line), []).append(what)
    return owners


def test_the_request_itself_only_moves_its_state_in_transition():
    # by the same rules as the other modules': assignments of any kind, and in-place list changes
    assert request_writers() == {"transition": ["assigns .state"]}


def test_the_requests_own_writes_are_seen(tmp_path):
    path = tmp_path / "request.py"
    path.write_text(
        "class Request:\n"
        "    def transition(self, new):\n"
        "        self.state = new\n"
        "    def advance(self, n):\n"
        "        self.num_computed += n\n"
        "    def emit(self, t):\n"
        "        self.output_token_ids.append(t)\n"
        "    def reset(self):\n"
        "        self.transition(None)\n"
    )
    assert request_writers(path) == {
        "transition": ["assigns .state"],
        "advance": ["assigns .num_computed"],
        "emit": ["changes .output_token_ids"],
        "reset": ["calls .transition"],
    }


@pytest.mark.parametrize(
    "source,expected",
    [
        ("r.num_computed = 3", 1),
        ("r.num_scheduled += n", 1),
        ("a.state, b = x", 1),
        ("r.token_times_s.append(now)", 1),
        ("r.transition(s)", 1),
        ("chunk.start = 4; x = r.num_computed; r.prompt_len", 0),
        ("app.state.engine = e; self.deadline_s = 1.0", 0),  # not a request's fields
    ],
)
def test_the_check_sees_writes(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source + "\n")
    assert len(writes(path)) == expected


def packer_sources() -> list[Path]:
    return sorted(PACKERS.glob("*.py"))


def test_packers_never_touch_the_kv_arbiter():
    assert len(packer_sources()) >= 4
    for path in packer_sources():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] + [a.name for a in node.names]
                assert not any("kv_arbiter" in n or n == "KVArbiter" for n in names), path.name
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("kv", "_kv", "reserve", "make_room", "preempt"), (
                    f"{path.name}:{node.lineno} reaches .{node.attr}"
                )
            if isinstance(node, ast.Name):
                assert node.id != "KVArbiter", path.name

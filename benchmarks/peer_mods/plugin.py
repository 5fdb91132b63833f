"""pytest plugin for running FlashAttention's upstream tests of a suite (PEER_SUITE, laid out by run.sh in
.peer/<suite>/) against this project: fa4mods, FA4's score_mod / mask_mod / block-sparsity tests against
flash_attn.cute (plan.py); fa3, FA3's hopper/test_flash_attn.py against the top-level flash_attn_interface
(plan_fa3.py).

What it does, in order:
- CPU collection mode: without a CUDA device, torch.cuda.get_device_capability returns (9, 0) from the moment this
  plugin is imported (before any test module), because the upstream modules call it at import time. This is for
  ``--collect-only`` checks on a CPU machine only; running the tests there is meaningless.
- Shims (plan.SHIMS): a name the upstream modules import that the real module lacks gets a stand-in that raises
  PeerMissing when called. A name the project has is never shadowed; a missing module is never faked.
- Sampling (plan.SAMPLE, plan.DEFAULT_N, PEER_SEED, PEER_SCALE): each test function keeps a fixed random sample
  of its items (the same in every xdist worker, which xdist requires); plan.DESELECT drops whole functions.
- Budget (PEER_BUDGET seconds, default 540, from the start of the run): later items are skipped as "peer budget".
- Classification: passed / failed / skipped / xfailed / unsupported (NotImplementedError) / missing_api
  (PeerMissing) / not_run (budget). Each process appends its items to $OUT/<results>/items/<worker>.jsonl
  (<results>: peer_mods or peer_fa3, with _control for PEER_CONTROL=1); the controller merges them into
  results.json and summary.txt there and prints the summary last.
"""
import json
import os
import random
import time
from collections import Counter
from importlib import import_module
from pathlib import Path

import pytest
import torch

SUITE = os.environ.get("PEER_SUITE", "fa4mods")
_PLAN, _NAME, _WHAT = {"fa4mods": ("plan", "peer_mods", "FA4 {ref} tests/cute vs flash_attn.cute"),
                       "fa3": ("plan_fa3", "peer_fa3", "FA3 {ref} hopper/test_flash_attn.py vs flash_attn_interface")
                       }[SUITE]
try:
    plan = import_module(f"benchmarks.peer_mods.{_PLAN}")
except ImportError:  # PEER_CONTROL=1: loaded from its folder (the project is not on sys.path then)
    plan = import_module(_PLAN)

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # None in the controller (or in a run without xdist)
OUT_DIR = Path(os.environ.get("OUT", ".peer/out")).resolve() / (
    f"{_NAME}_control" if os.environ.get("PEER_CONTROL") == "1" else _NAME)
ITEMS_DIR = OUT_DIR / "items"
UPSTREAM = Path(__file__).resolve().parents[2] / ".peer" / SUITE / "UPSTREAM"
CLASSES = ("passed", "failed", "skipped", "xfailed", "unsupported", "missing_api", "not_run")
BUDGET_REASON = "peer budget"


class PeerMissing(Exception):
    """Raised by a shim: the test needs a name that this project does not have."""


# --- CPU collection mode -------------------------------------------------------------------------------------
CPU_COLLECTION = not torch.cuda.is_available()
if CPU_COLLECTION:
    torch.cuda.get_device_capability = lambda device=None: (9, 0)


# --- shims ---------------------------------------------------------------------------------------------------
def _stub(qualname, reason):
    def stand_in(*args, **kwargs):
        raise PeerMissing(f"{qualname} is not in this project ({reason})")

    stand_in.__name__ = stand_in.__qualname__ = qualname.rsplit(".", 1)[1]
    return stand_in


def _install_shims():
    installed, present, missing_modules = [], [], {}
    for mod_name, attr, reason in plan.SHIMS:
        try:
            mod = import_module(mod_name)
        except Exception as e:  # the module itself is missing or broken: report it, never fake it
            missing_modules[mod_name] = f"{type(e).__name__}: {e}"
            continue
        if hasattr(mod, attr):
            present.append(f"{mod_name}.{attr}")
        else:
            setattr(mod, attr, _stub(f"{mod_name}.{attr}", reason))
            installed.append(f"{mod_name}.{attr}")
    return {"installed": installed, "present": present, "missing_modules": missing_modules}


SHIMS = _install_shims()


# --- helpers -------------------------------------------------------------------------------------------------
def _key(item):
    return f"{item.path.name}::{getattr(item, 'originalname', item.name)}"


def _first_line(text, limit=200):
    text = str(text).strip()
    return (text.splitlines() or [""])[0][:limit]


def _caused_by(exc, exc_type):
    # the exception or one it was explicitly raised from (`raise X from e`, as wrappers of the DSL do)
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, exc_type):
            return True
        seen.add(id(exc))
        exc = exc.__cause__
    return False


def _failure_message(rep):
    crash = getattr(rep.longrepr, "reprcrash", None)
    return _first_line(crash.message if crash is not None else rep.longrepr)


def _classify(rep, call):
    """The class a report decides, or None (a passing setup or teardown decides nothing)."""
    if rep.passed:
        return "passed" if rep.when == "call" else None
    if rep.skipped:
        if hasattr(rep, "wasxfail"):
            return "xfailed"
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        return "not_run" if BUDGET_REASON in reason else "skipped"
    exc = call.excinfo.value if call.excinfo is not None else None
    if _caused_by(exc, PeerMissing):
        return "missing_api"
    if _caused_by(exc, NotImplementedError):
        return "unsupported"
    return "failed"


def _sample_size(key):
    scale = float(os.environ.get("PEER_SCALE", "1"))
    return max(1, round(plan.SAMPLE.get(key, plan.DEFAULT_N) * scale))


# --- state of this process -----------------------------------------------------------------------------------
_records = {}  # nodeid -> record of the item now running
_collect = {"functions": {}, "errors": {}}
_controller_failures = {}  # nodeid -> message, failed reports the controller saw (a crashed worker writes none)
_start = _deadline = None


def pytest_configure(config):
    global _start, _deadline
    _start = time.time()
    if WORKER is None:
        # The controller starts the clock and clears old item files before any xdist worker starts;
        # workers inherit PEER_DEADLINE and OUT through the environment.
        budget = float(os.environ.get("PEER_BUDGET", "540"))
        os.environ["PEER_DEADLINE"] = str(time.time() + budget)
        os.environ["OUT"] = str(OUT_DIR.parent)
        ITEMS_DIR.mkdir(parents=True, exist_ok=True)
        for old in ITEMS_DIR.glob("*.json*"):
            old.unlink()
    _deadline = float(os.environ["PEER_DEADLINE"])


def pytest_collectreport(report):
    if report.failed:
        lines = [ln[1:].strip() for ln in str(report.longrepr).splitlines() if ln.startswith("E ")]
        _collect["errors"][report.nodeid] = _first_line(lines[-1] if lines else report.longrepr, 300)


def pytest_collection_modifyitems(session, config, items):
    seed = os.environ.get("PEER_SEED", "0")
    groups = {}
    for item in items:
        groups.setdefault(_key(item), []).append(item.nodeid)
    keep = set()
    for key, ids in groups.items():
        info = {"collected": len(ids), "selected": 0}
        if key in plan.DESELECT:
            info["deselected"] = plan.DESELECT[key]
        else:
            n = _sample_size(key)
            chosen = sorted(ids) if len(ids) <= n else random.Random(f"{seed}:{key}").sample(sorted(ids), n)
            keep.update(chosen)
            info["selected"] = len(chosen)
        _collect["functions"][key] = info
    dropped = [it for it in items if it.nodeid not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [it for it in items if it.nodeid in keep]


def pytest_collection_finish(session):
    ITEMS_DIR.mkdir(parents=True, exist_ok=True)
    (ITEMS_DIR / f"collect-{WORKER or 'main'}.json").write_text(json.dumps(_collect, indent=1))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if time.time() > _deadline:
        pytest.skip(BUDGET_REASON)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    rec = _records.setdefault(item.nodeid, {"nodeid": item.nodeid, "key": _key(item), "class": None,
                                            "message": "", "duration": 0.0, "worker": WORKER or "main"})
    rec["duration"] += rep.duration
    cls = _classify(rep, call)
    if cls is not None and rec["class"] in (None, "passed"):  # a teardown error still fails a passed item
        rec["class"] = cls
        if cls in ("failed", "unsupported", "missing_api"):
            rec["message"] = _failure_message(rep)
    if rep.when == "teardown":
        rec["class"] = rec["class"] or "failed"
        with open(ITEMS_DIR / f"{WORKER or 'main'}.jsonl", "a") as f:  # one line per item: a crash loses little
            f.write(json.dumps(_records.pop(item.nodeid)) + "\n")


def pytest_runtest_logreport(report):
    if WORKER is None and report.failed:
        _controller_failures.setdefault(report.nodeid, _failure_message(report))


# --- merge and summary (controller) --------------------------------------------------------------------------
def _merge():
    functions, errors = {}, {}
    for path in sorted(ITEMS_DIR.glob("collect-*.json")):  # every worker collects the same items
        data = json.loads(path.read_text())
        for key, info in data["functions"].items():
            functions.setdefault(key, info)
        errors.update(data["errors"])
    items = {}
    for path in sorted(ITEMS_DIR.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            items[rec["nodeid"]] = rec
    for nodeid, message in _controller_failures.items():
        if nodeid not in items:  # its worker died before writing it
            key = f"{nodeid.split('::')[0].rsplit('/', 1)[-1]}::{nodeid.split('::')[-1].split('[')[0]}"
            items[nodeid] = {"nodeid": nodeid, "key": key, "class": "failed", "message": message,
                             "duration": 0.0, "worker": "crashed"}
    for info in functions.values():
        info["counts"] = Counter()
    for rec in items.values():
        info = functions.setdefault(rec["key"], {"collected": 0, "selected": 0, "counts": Counter()})
        info["counts"][rec["class"]] += 1
    return functions, errors, sorted(items.values(), key=lambda r: r["nodeid"])


def _summary(meta, functions, errors, items, totals):
    width = max([len(k) for k in functions] + [40])
    cols = ("coll", "sel") + tuple(c[:7] for c in CLASSES)
    lines = [f"{_NAME}: {_WHAT.format(ref=meta['upstream'])}  seed {meta['seed']}  "
             f"scale {meta['scale']}  budget {meta['budget_s']} s  wall {meta['wall_s']} s",
             f"shims installed: {', '.join(meta['shims']['installed']) or '-'}",
             f"shim names the project has: {', '.join(meta['shims']['present']) or '-'}"]
    lines += [f"shim module missing: {m} ({why})" for m, why in meta["shims"]["missing_modules"].items()]
    if errors:
        lines.append("import / collection errors:")
        lines += [f"  {nodeid}: {msg}" for nodeid, msg in sorted(errors.items())]
    lines.append(f"{'file::function':<{width}} " + " ".join(f"{c:>7}" for c in cols))
    for key in sorted(functions):
        info = functions[key]
        row = [info["collected"], info["selected"]] + [info["counts"][c] for c in CLASSES]
        lines.append(f"{key:<{width}} " + " ".join(f"{v:>7}" for v in row))
    lines.append(f"{'totals':<{width}} " + " ".join(f"{totals[c]:>7}" for c in ("collected", "selected") + CLASSES))
    deselected = {k: i["deselected"] for k, i in functions.items() if "deselected" in i}
    if deselected:
        lines.append("deselected (plan.DESELECT):")
        lines += [f"  {k}: {why}" for k, why in sorted(deselected.items())]
    bad = [r for r in items if r["class"] in ("failed", "unsupported", "missing_api")]
    if bad:
        lines.append("failed / unsupported / missing_api (first line):")
        lines += [f"  [{r['class']}] {r['nodeid']}: {r['message']}" for r in bad]
    return "\n".join(lines) + "\n"


_summary_text = None


def pytest_sessionfinish(session, exitstatus):
    global _summary_text
    if WORKER is not None:
        return
    functions, errors, items = _merge()
    totals = Counter({"collected": sum(i["collected"] for i in functions.values()),
                      "selected": sum(i["selected"] for i in functions.values())})
    for info in functions.values():
        totals.update(info["counts"])
    meta = {"upstream": (UPSTREAM.read_text().split() or ["?"])[0] if UPSTREAM.exists() else "?",
            "seed": os.environ.get("PEER_SEED", "0"), "scale": float(os.environ.get("PEER_SCALE", "1")),
            "budget_s": float(os.environ.get("PEER_BUDGET", "540")),
            "wall_s": round(time.time() - _start, 1),
            "collect_only": bool(session.config.option.collectonly), "cpu_collection": CPU_COLLECTION,
            "shims": SHIMS, "exitstatus": int(exitstatus)}
    _summary_text = _summary(meta, functions, errors, items, totals)
    results = {"meta": meta, "totals": dict(totals), "import_errors": errors,
               "functions": {k: {**i, "counts": dict(i["counts"])} for k, i in functions.items()}, "items": items}
    (OUT_DIR / "results.json").write_text(json.dumps(results, indent=1))
    (OUT_DIR / "summary.txt").write_text(_summary_text)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    yield  # the outermost wrapper: the summary comes after pytest's own short summary (-rA), i.e. last
    if _summary_text:
        terminalreporter.write_sep("=", f"{_NAME} summary")
        terminalreporter.write(_summary_text)

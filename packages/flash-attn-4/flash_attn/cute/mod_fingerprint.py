"""A stable description of a user's CuTeDSL mod function across processes (``fingerprint``), for the disk cache of the
mod kernels (mods.py): the function's source text (what CuTeDSL compiles) and the values of everything it reads by name
at trace time (closure cells, globals, defaults), recursively through the functions it calls.

Safety first: a kernel compiled from a function is reused in a later process only if that process's function has the
same fingerprint, so whatever could change the traced code must be in it. What cannot be described exactly gives
None, and that call's kernel stays in memory only: a value of another kind than None / bool / int / float / str /
bytes / tuple / list / frozenset of those, a module other than the libraries the kernel's key already versions
(``cutlass`` with nvidia-cutlass-dsl's version, ``flash_attn`` with the package sources' hash, ``math``, ``operator``),
an object of a user-defined class, a function whose source Python cannot read (a lambda in a REPL, exec()).
The source is taken from the ``def`` line on: the decorator (``@cute.jit``) is not part of it (once CuTeDSL has
compiled a function, Python reports its source without the decorator lines), so two mods that differ only in their
``cute.jit`` options share a fingerprint.
"""
import ast
import inspect
import textwrap
import types

# Modules whose attributes a mod may read: the disk key holds their versions (cache.environment, cache.source_hash),
# or they are the standard library's pure functions.
_VERSIONED = ("cutlass", "flash_attn", "math", "operator")
_SIMPLE = (type(None), bool, int, float, str, bytes)


def _library(name):
    return any(name == root or name.startswith(root + ".") for root in _VERSIONED)


class _Unstable(Exception):
    """Something the function reads has no stable description."""


def _value(v, seen):
    if isinstance(v, _SIMPLE):
        return [type(v).__name__, repr(v)]
    if isinstance(v, (tuple, list, frozenset)):
        items = sorted((_value(x, seen) for x in v), key=repr) if isinstance(v, frozenset) else [_value(x, seen)
                                                                                                  for x in v]
        return [type(v).__name__, items]
    if isinstance(v, types.ModuleType):
        if not _library(v.__name__):
            raise _Unstable(f"module {v.__name__}")
        return ["module", v.__name__]
    f = inspect.unwrap(v) if callable(v) else v
    if isinstance(f, types.FunctionType):
        if _library(f.__module__ or "") and "<locals>" not in f.__qualname__ and not f.__closure__:
            return ["lib", f.__module__, f.__qualname__]  # a library's module-level function: its sources are keyed
        # a user's function, or one a library built at run time (a closure: mod_library's, per constant)
        return ["fn", _function(v, seen)]
    module = getattr(v, "__module__", None) or ""
    if (inspect.isclass(v) or callable(v)) and _library(module):
        return ["lib", module, getattr(v, "__qualname__", getattr(v, "__name__", repr(type(v))))]
    raise _Unstable(f"{type(v).__name__} value")


def _function(fn, seen):
    f = inspect.unwrap(fn)
    if not isinstance(f, types.FunctionType):
        raise _Unstable(f"{type(f).__name__} is not a Python function")
    if id(f) in seen:  # recursion: the function is described where it was first met
        return ["recursive", f.__module__, f.__qualname__]
    seen = seen | {id(f)}
    try:
        source = _definition(inspect.getsource(f))
    except (OSError, TypeError):
        raise _Unstable(f"no source for {f.__qualname__}") from None
    code = f.__code__
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in (f.__closure__ or ()))))
    names = sorted(n for n in _names(source) if n in f.__globals__ and n not in cells)
    return {
        "name": f"{f.__module__}.{f.__qualname__}",
        "source": source,
        "closure": {n: _value(v, seen) for n, v in sorted(cells.items())},
        "globals": {n: _value(f.__globals__[n], seen) for n in names},
        "defaults": _value(f.__defaults__ or (), seen),
        "kwdefaults": {n: _value(v, seen) for n, v in sorted((f.__kwdefaults__ or {}).items())},
    }


def _definition(source):
    """The function's source from its ``def`` line, dedented: the decorator lines above it are left out (once CuTeDSL has
    compiled a @cute.jit function, inspect reports its source without them)."""
    lines = textwrap.dedent(source).splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("def ", "async def ")):
            return "".join(lines[i:])
    return "".join(lines)


def _names(source):
    """The bare names the source reads (global or closure lookups; attributes are read through them)."""
    return {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}


def fingerprint(fn):
    """A JSON-able description of mod function ``fn`` that is equal in two processes only if tracing it gives the same
    kernel code (given the same kernel facts, library versions and package sources), or None when something it reads
    has no stable description (the module docstring lists what has one)."""
    try:
        return _function(fn, frozenset())
    except _Unstable:
        return None
    except ValueError:  # a cell never filled (a closure over a name assigned later)
        return None

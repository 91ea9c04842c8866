"""The grading program (issue 58): the only code of ours that runs next to model code, in a fresh grading sandbox.

envs/grading.py runs this file's text as `python3 -I -S -B -c <text>` and sends the calls on stdin. It holds no
expected value, no verdict and no token: it reads the calls, makes the working dir importable AFTER the standard
library, imports the module under test, makes each call and writes what came back, one JSON line per call, as a
type-tagged plain value (`["int", "3"]`, `["list", [...]]`); a value that is not plain data (an object whose `==`
says yes to everything, a generator) is written as `{"i": k, "bad": "<type>"}` and fails its case on the host.
Whatever the model's code does in this process (patch json, builtins, this module), the worst it can do is write
lines the host did not ask for: the host compares the values with expected values that never left it.

The last line, `{"end": ...}`, names every name the run changed in builtins, in this module and in the modules
loaded before the code under test (json.dumps patched, a fake name added): the host counts them as suspected
tampering, never as a verdict. Standard library only; also imported by the host for `encode`/`decode`.
"""

import builtins
import importlib
import json
import os
import sys

MAX_DEPTH = 64
_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


class NotPlain(ValueError):
    """A value that is not plain data (the type is named), or nested deeper than MAX_DEPTH."""


def _plain_stdlib_subclasses():
    """Standard-library containers compared as their base type (an honest `Counter` answer is a dict)."""
    import collections

    return {collections.OrderedDict: dict, collections.defaultdict: dict, collections.Counter: dict}


_AS_BASE = _plain_stdlib_subclasses()


def encode(value, depth=0):
    """`value` as a type-tagged JSON tree; NotPlain for anything else (exact types only, no subclass)."""
    if depth > MAX_DEPTH:
        raise NotPlain("nested deeper than %d" % MAX_DEPTH)
    kind = type(value)
    kind = _AS_BASE.get(kind, kind)
    if value is None:
        return ["none"]
    if kind is bool:
        return ["bool", bool(value)]
    if kind is int:
        try:
            return ["int", int.__repr__(value)]
        except ValueError:  # past the int -> str digit limit
            raise NotPlain("int too large") from None
    if kind is float:
        return ["float", float.__repr__(value)]
    if kind is str:
        return ["str", value]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind is list or kind is tuple:
        return [kind.__name__, [encode(v, depth + 1) for v in value]]
    if kind is dict:
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(value)]]
    if kind is set or kind is frozenset:
        items = [encode(v, depth + 1) for v in value]
        return [kind.__name__, sorted(items, key=json.dumps)]
    raise NotPlain("%s.%s" % (type.__getattribute__(type(value), "__module__"),
                              type.__getattribute__(type(value), "__qualname__"))[:200])


def decode(tree):
    """The plain value of a type-tagged tree; ValueError on anything malformed (an unknown tag, a wrong shape)."""
    if not isinstance(tree, list) or not tree or not isinstance(tree[0], str):
        raise ValueError("not a tagged value: %r" % (tree,))
    tag, body = tree[0], tree[1:]
    if tag == "none" and not body:
        return None
    if len(body) != 1:
        raise ValueError("tag %r takes one body" % tag)
    body = body[0]
    if tag == "bool" and type(body) is bool:
        return body
    if tag in ("int", "float") and type(body) is str:
        return _SCALARS[tag](body)
    if tag == "str" and type(body) is str:
        return body
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag in ("list", "tuple", "set", "frozenset") and type(body) is list:
        items = [decode(v) for v in body]
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
        return {decode(k): decode(v) for k, v in body}
    raise ValueError("bad tagged value %r" % (tree[:1],))


def _snapshot():
    """Every name of builtins, of this module and of each module loaded so far, with the object it holds."""
    spaces = {"builtins": vars(builtins), "__main__": vars(sys.modules["__main__"])}
    for name, module in list(sys.modules.items()):
        if name not in spaces and name != "sys" and module is not None:
            spaces[name] = vars(module)
    hooks = {"sys.meta_path": list(sys.meta_path), "sys.path_hooks": list(sys.path_hooks)}
    return [(name, space, dict(space)) for name, space in spaces.items()], hooks


def _changed(snapshot):
    """The names changed since `snapshot`: any change in builtins and __main__; in other modules a name rebound
    or removed (a submodule imported later adds a name to its package: not a change); an import hook added."""
    spaces, hooks = snapshot
    out = []
    for name, space, before in spaces:
        strict = name in ("builtins", "__main__")
        for key in set(before) | set(space):
            if key not in space or (key in before and space[key] is not before[key]) or (strict and key not in before):
                out.append("%s.%s" % (name, key))
    for name, seen in hooks.items():
        now = getattr(sys, name.split(".")[1])
        if list(now) != seen:
            out.append(name)
    return sorted(out)[:50]


def _call(request):
    """One call: import the module, find the function, call it with fresh args; what came back, tagged."""
    try:
        target = importlib.import_module(request["module"])
        for part in request["function"].split("."):
            target = getattr(target, part)
        value = target(*decode(request["args"]), **decode(request["kwargs"]))
    except BaseException as e:  # noqa: BLE001 - the call's own failure (SystemExit too) is its result
        return {"raised": type(e).__name__[:200]}
    try:
        return {"value": encode(value)}
    except NotPlain as e:
        return {"bad": str(e)}
    except BaseException as e:  # noqa: BLE001 - a value whose inspection raised is not plain data
        return {"bad": "unreadable (%s)" % type(e).__name__[:200]}


def main():
    """Read the calls, isolate the path, make them, write the results on a private descriptor, end hard."""
    calls = json.loads(sys.stdin.buffer.read())["calls"]
    write, dumps, exit_now = os.write, json.dumps, os._exit
    out = os.dup(1)
    os.dup2(2, 1)  # the code under test prints to stderr; the results leave on `out` only
    here = os.getcwd()
    sys.path[:] = [p for p in sys.path if p and p not in (".", here)] + [here]  # stdlib first, the task last
    snapshot = _snapshot()
    for k, request in enumerate(calls):
        result = _call(request)
        result["i"] = k
        write(out, (dumps(result) + "\n").encode())
    write(out, (dumps({"end": True, "changed": _changed(snapshot)}) + "\n").encode())
    exit_now(0)  # no atexit handler of the code under test runs after the last line


if __name__ == "__main__":
    main()

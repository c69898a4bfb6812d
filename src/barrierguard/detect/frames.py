"""Find the user's line, and the framework line, of a synchronization.

Runs at every synchronization: a file's class and an instruction's kind are worked out once.
"""

from __future__ import annotations

import ast
import contextlib
import dis
import functools
import importlib.util
import linecache
import os
import sysconfig
from dataclasses import dataclass, field
from types import CodeType, FrameType

from barrierguard.detect.kinds import kind_for_call

__all__ = ["Location", "absolute", "classify_file", "kind_at", "place"]

USER = 0
TORCH = 1
FRAMEWORK = 2
LIBRARY = 3
OWN = 4

# Packages whose syncs are reported as "framework:<name>" rather than "user".
KNOWN_FRAMEWORKS: dict[str, str] = {
    **dict.fromkeys(("lightning", "pytorch_lightning", "lightning_fabric"), "lightning"),
    **{n: n for n in ("torchmetrics", "accelerate", "transformers", "deepspeed", "ignite")},
}

# Parts of torch that are frameworks in their own right: a sync inside them is theirs
# (GradScaler.step reads found_inf), not the user's tensor code.
TORCH_FRAMEWORKS: tuple[tuple[str, str], ...] = (
    ("amp", "torch.amp"),
    ("cuda/amp", "torch.amp"),
    ("optim", "torch.optim"),
    ("nn/utils", "torch.nn.utils"),
    ("nn/parallel", "torch.nn.parallel"),
    ("utils/data", "torch.utils.data"),
    ("distributed", "torch.distributed"),
)

_OWN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Own files that are not machinery: the demo is user code, and MetricBuffer's transfer is a
# framework's ("framework:barrierguard", allowed by default).
_OWN_EXCEPTIONS = {_OWN_ROOT + os.path.join("cli", "demo.py"): (USER, "")}
_OWN_FRAMEWORK_DIR = _OWN_ROOT + "metrics" + os.sep


def _inductor_generated(path: str) -> bool:
    """Whether ``path`` is code that inductor generated (its cache: kernels, wrappers)."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache and path.startswith(os.path.abspath(cache) + os.sep):
        return True
    return any(part.startswith("torchinductor_") for part in path.split(os.sep)[:-1])


def _package_root(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.abspath(next(iter(spec.submodule_search_locations))) + os.sep


@functools.cache
def _roots() -> list[tuple[str, int, str]]:
    """The folders of barrierguard, torch and the known frameworks: ``(prefix, category, name)``."""
    roots: list[tuple[str, int, str]] = [(_OWN_ROOT, OWN, "barrierguard")]
    torch_root = _package_root("torch")
    if torch_root is not None:
        for sub, name in TORCH_FRAMEWORKS:
            roots.append((torch_root + sub.replace("/", os.sep) + os.sep, FRAMEWORK, name))
        roots.append((torch_root, TORCH, "torch"))
    for pkg, name in KNOWN_FRAMEWORKS.items():
        root = _package_root(pkg)
        if root is not None:
            roots.append((root, FRAMEWORK, name))
    # Longest prefix first, so torch/amp/ wins over torch/.
    return sorted(roots, key=lambda r: len(r[0]), reverse=True)


def _classify(filename: str) -> tuple[int, str]:
    if filename.startswith("<"):
        # <frozen runpy> is the standard library, <eval_with_key>.N a torch.fx graph;
        # <string>, <stdin> and notebook cells are the user's code.
        if filename.startswith("<eval_with_key>"):
            return TORCH, "torch"
        return (LIBRARY, "python") if filename.startswith("<frozen") else (USER, "")
    path = os.path.abspath(filename)
    if _inductor_generated(path):
        return TORCH, "torch"
    if path in _OWN_EXCEPTIONS:
        return _OWN_EXCEPTIONS[path]
    if path.startswith(_OWN_FRAMEWORK_DIR):
        return FRAMEWORK, "barrierguard"
    for prefix, category, name in _roots():
        if path.startswith(prefix):
            return category, name
    parts = path.split(os.sep)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            i = parts.index(marker)
            top = parts[i + 1].removesuffix(".py") if i + 1 < len(parts) else ""
            known = KNOWN_FRAMEWORKS.get(top)
            return (LIBRARY, top) if known is None else (FRAMEWORK, known)
    for key in ("stdlib", "platstdlib"):
        stdlib = sysconfig.get_paths().get(key)
        if stdlib and path.startswith(os.path.abspath(stdlib) + os.sep):
            return LIBRARY, "python"
    return USER, ""


class _Classifier:
    """Caches what each source file is: user code, torch, a framework, a library."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, str]] = {}

    def classify(self, filename: str) -> tuple[int, str]:
        hit = self._cache.get(filename)
        if hit is None:
            hit = self._cache[filename] = _classify(filename)
        return hit


_classifier = _Classifier()


def classify_file(filename: str) -> tuple[int, str]:
    """Classify a source file: ``(category, framework name)``, cached."""
    return _classifier.classify(filename)


@dataclass(eq=False, repr=False, slots=True)
class Location:
    """Where a synchronization happened, as seen on the Python stack (interned by :func:`place`).
    ``key`` names the site: two framework syncs behind one user line are two sites."""

    file: str
    line: int
    function: str
    kind: str
    detail: str
    origin: str
    framework_file: str | None = None
    framework_line: int | None = None
    framework_function: str | None = None
    key: tuple[str, int, str, str, str, int] = field(init=False)

    def __post_init__(self) -> None:
        where = (self.framework_file or "", self.framework_line or 0)
        self.key = (self.file, self.line, self.kind, self.origin, *where)

    def __repr__(self) -> str:
        return f"Location({self.file}:{self.line} {self.kind} {self.origin})"


_BOOL_OPS = frozenset(
    {
        "POP_JUMP_IF_FALSE",
        "POP_JUMP_IF_TRUE",
        "POP_JUMP_FORWARD_IF_FALSE",
        "POP_JUMP_FORWARD_IF_TRUE",
        "POP_JUMP_BACKWARD_IF_FALSE",
        "POP_JUMP_BACKWARD_IF_TRUE",
        "JUMP_IF_FALSE_OR_POP",
        "JUMP_IF_TRUE_OR_POP",
        "TO_BOOL",
        "UNARY_NOT",
        "CONTAINS_OP",
        "COMPARE_OP",
    }
)
_INDEX_OPS = frozenset({"BINARY_SUBSCR", "STORE_SUBSCR", "BINARY_SLICE", "STORE_SLICE"})
_FORMAT_OPS = frozenset({"FORMAT_VALUE", "FORMAT_SIMPLE", "FORMAT_WITH_SPEC", "CONVERT_VALUE"})
_CALL_OPS = frozenset(
    {
        "CALL",
        "CALL_KW",
        "CALL_FUNCTION",
        "CALL_FUNCTION_KW",
        "CALL_FUNCTION_EX",
        "CALL_METHOD",
        "PRECALL",
    }
)

# The direction of a copy by the call that makes it.
_COPY_DIRECTIONS = {
    **dict.fromkeys(("cpu", "numpy", "save"), "d2h"),
    **dict.fromkeys(("cuda", "tensor", "load", "load_state_dict"), "h2d"),
}

_kind_cache: dict[tuple[CodeType, int], tuple[str, str]] = {}


def _instruction(code: CodeType, lasti: int) -> tuple[str, int]:
    """The name and offset of the instruction at ``lasti`` (``""`` past the end); a frame in a
    Python call points at its CALL's last inline CACHE (3.11+), the CALL is named."""
    raw = code.co_code
    try:
        opname = dis.opname[raw[lasti]]
        while opname == "CACHE" and lasti >= 2:
            lasti -= 2
            opname = dis.opname[raw[lasti]]
    except IndexError:
        opname = ""
    return opname, lasti


def _source_segment(code: CodeType, lasti: int) -> str | None:
    positions = getattr(code, "co_positions", None)
    if positions is None:
        return None
    try:
        pos = list(positions())[lasti // 2]
    except IndexError:
        return None
    start, end, col, end_col = pos
    if start is None or end is None or col is None or end_col is None:
        return None
    lines = linecache.getlines(code.co_filename)
    if not lines or end > len(lines):
        return None
    chunk = [ln.encode("utf-8") for ln in lines[start - 1 : end]]  # columns count bytes
    chunk[-1] = chunk[-1][:end_col]
    chunk[0] = chunk[0][col:]
    return b"".join(chunk).decode("utf-8", errors="replace")


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute):
            return func.attr
        if isinstance(func, ast.Name):
            return func.id
    return None


def _kind_from_call(code: CodeType, lasti: int, lineno: int) -> tuple[str, str]:
    segment = _source_segment(code, lasti)
    name: str | None = None
    if segment is not None:
        with contextlib.suppress(SyntaxError):
            name = _call_name(ast.parse("(" + segment + "\n)", mode="eval").body)
    if name is None:
        # No column positions (3.10) or no source: the line's last known synchronizing call.
        line = linecache.getline(code.co_filename, lineno).strip()
        try:
            module = ast.parse(line.rstrip(":"), mode="exec")
        except SyntaxError:
            return "call", ""
        names = [n for n in (_call_name(x) for x in ast.walk(module)) if n is not None]
        known = [n for n in names if kind_for_call(n) != "call"]
        name = known[-1] if known else (names[0] if names else None)
    if name is None:
        return "call", ""
    kind = kind_for_call(name)
    if kind == "copy":
        return kind, _COPY_DIRECTIONS.get(name, "")
    return kind, (name if kind in ("call", "collective") else "")


def kind_at(frame: FrameType) -> tuple[str, str]:
    """The kind of the instruction ``frame`` is executing, with a detail string (cached)."""
    code = frame.f_code
    lasti = frame.f_lasti
    key = (code, lasti)
    hit = _kind_cache.get(key)
    if hit is not None:
        return hit
    opname, lasti = _instruction(code, lasti)
    if opname in _CALL_OPS:
        result = _kind_from_call(code, lasti, frame.f_lineno)
    elif opname in _BOOL_OPS:
        result = ("bool", "")
    elif opname in _INDEX_OPS:
        result = ("index", "")
    elif opname in _FORMAT_OPS:
        result = ("format", "")
    else:
        result = ("call", opname.lower())
    _kind_cache[key] = result
    return result


# Keyed by code ids (hashing a code hashes its constants); each entry keeps its codes alive.
_location_cache: dict[tuple[object, ...], tuple[Location, CodeType, CodeType]] = {}


def absolute(filename: str) -> str:
    """``filename`` (a relative ``co_filename`` of a script) as an absolute path; ``<stdin>``,
    ``<string>`` and the like unchanged.

    Example:
        >>> import os
        >>> absolute("train.py") == os.path.join(os.getcwd(), "train.py")
        True
        >>> absolute("<stdin>")
        '<stdin>'
    """
    if filename.startswith("<") or os.path.isabs(filename):
        return filename
    return os.path.abspath(filename)


def place(
    innermost: FrameType,
    framework: FrameType | None,
    framework_name: str,
    user: FrameType | None,
    kind: str | None = None,
    detail: str = "",
) -> Location:
    """The interned location of a walk's result (a cache lookup for a path seen before).

    Args:
        innermost: The innermost frame that is not barrierguard's.
        framework: The innermost framework frame, if any.
        framework_name: Its framework's name.
        user: The first user frame, or ``None`` when the stack has none.
        kind: The kind, when known; else read from the executing instruction.
        detail: Extra detail for a known kind.
    """
    if user is None:  # only library frames (python -m of an installed module)
        user = framework or innermost
    probe = framework if framework is not None else user
    user_code, probe_code = user.f_code, probe.f_code
    # Instruction offsets name the line as well as f_lineno, which a frame computes.
    key = (id(user_code), user.f_lasti, id(probe_code), probe.f_lasti, kind, detail)
    hit = _location_cache.get(key)
    if hit is not None and hit[1] is user_code and hit[2] is probe_code:
        return hit[0]
    if kind is None:
        kind, detail = kind_at(probe)
    origin = "user"
    where: tuple[str, int | None, str] | tuple[()] = ()
    if framework is not None:
        code = framework.f_code
        origin = "framework:" + framework_name
        where = (absolute(code.co_filename), framework.f_lineno, code.co_name)
    loc = Location(
        absolute(user_code.co_filename),
        user.f_lineno,
        user_code.co_name,
        kind,
        detail,
        origin,
        *where,
    )
    if len(_location_cache) < 100_000:
        _location_cache[key] = (loc, user_code, probe_code)
    return loc

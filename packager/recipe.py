"""Build recipes: what ``edgepack build`` may choose from, and the budgets it must meet.

A recipe is a TOML file (read with :mod:`tomllib`); every key is optional and the
defaults make a good 4-bit-ish build. Parsing validates everything up front (types,
encodings, regexes, budgets), so a bad recipe fails before minutes of calibration:
:class:`RecipeError` names the key.

.. code-block:: toml

    [quantize]
    encodings = ["int4-asym", "int4-s8", "int4-asym-s8", "int3-s8", "int3-asym-s8", "int8"]
                                    # kinds int4|int3|int2[-asym][-s8] (-s8: 8-bit group
                                    # scales), int8, f16, f32, or full labels (int4-g64)
    group_sizes = [32]              # crossed with the group kinds above (8..128, powers
                                    # of two; native kernels run multiples of 32 fastest)
    algorithm = "gptq"              # "rtn" or "gptq"
    act_order = true                # GPTQ: columns in decreasing Hessian diagonal order
    damp = 0.01                     # GPTQ: damping, fraction of the mean Hessian diagonal
    block_size = 128                # GPTQ: columns per lazy batch update
    scale_search = true             # choose group scales minimising Hessian-weighted error
    awq = false                     # activation-aware per-channel scales (folded in norms)
    smoothquant = 0.0               # migration strength alpha (0 = off)

    [factorize]                     # activation-aware SVD as a further candidate
    enabled = false
    ranks = [0.25, 0.5]             # fractions of min(rows, cols)
    factor_encoding = "int8"

    [protect]                       # regex on tensor names -> fixed encoding
    "embed\\.weight" = "int8"

    [search]
    target_bpw = 4.5                # or target_size (bytes of the whole file)
    latency_budget_ms = 0           # 0 = none; needs lut
    lut = ""
    method = "knapsack"             # or "greedy"
    probe = true                    # rescale error kinds by their measured KL (slower)

    [calibration]
    samples = 128                   # 128..512 (a file may hold fewer; all are used then)
    min_tokens = 16
    max_tokens = 192
    file = ""                       # text or JSONL ({"text": ...} per line)

    [kv_cache]
    keys = "int8"
    values = "int4"

    [eval]                          # after writing: PPL, KL, top-1 against the float model
    file = ""                       # held-out text (never the calibration file)
    ctx = 512                       # tokens per chunk (edgepack eval's protocol)
    chunks = 0                      # at most this many chunks (0 = the whole text)

    [[prefixes]]                    # build stores their KV caches (as --prefix-file)
    name = "system"
    text = "You are a helpful assistant."
    system = true                   # a system prompt: rendered through the chat template

    [[adapters]]                    # placeholders: used by the LoRA issue
    name = "style"
    path = "adapter/"
    merge = false
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomllib

from edgepack.format import Encoding
from edgepack.format.encodings import REGISTRY, by_label

from .encode import EncodingChoice, check_group_size, parse_encoding
from .errors import RecipeError

__all__ = [
    "AdapterSpec",
    "CalibrationSpec",
    "EvalSpec",
    "FactorizeSpec",
    "KVCachePolicy",
    "PrefixSpec",
    "QuantizeSpec",
    "Recipe",
    "RecipeError",
    "SearchSpec",
    "load_recipe",
    "parse_recipe",
]

_GROUP_KINDS = tuple(r.kind for r in REGISTRY if r.is_group and r.scale_bits == 16)
_KINDS = (*_GROUP_KINDS, *(f"{k}-s8" for k in _GROUP_KINDS), "int8", "f16", "f32")
ALGORITHMS = ("rtn", "gptq")
SEARCH_METHODS = ("knapsack", "greedy")


@dataclass(frozen=True)
class QuantizeSpec:
    # 8-bit group scales (-s8) cost half the bits of binary16 ones for the same error
    # (measured on SmolLM2); int4-g32-asym keeps binary16 scales because it reproduces a
    # Q4_1 source's grid exactly. Group 32 only: the native kernels' SIMD paths need
    # groups of 32 (g16 is better per bit at 3 bits but runs ~10x slower on a device)
    encodings: tuple[str, ...] = (
        "int4-asym",
        "int4-s8",
        "int4-asym-s8",
        "int3-s8",
        "int3-asym-s8",
        "int8",
    )
    group_sizes: tuple[int, ...] = (32,)
    algorithm: str = "gptq"
    act_order: bool = True
    damp: float = 0.01
    block_size: int = 128
    scale_search: bool = True
    awq: bool = False
    smoothquant: float = 0.0

    def candidates(self) -> list[EncodingChoice]:
        """Every encoding the search may pick for a 2-D tensor (before shape fitting)."""
        out: list[EncodingChoice] = []
        for kind in self.encodings:
            if "-g" in kind or kind in ("int8", "f16", "f32", "bf16"):
                out.append(parse_encoding(kind))
                continue
            base, *flags = kind.split("-")
            suffix = "".join(f"-{f}" for f in flags)  # "-asym", "-s8", in that order
            for g in self.group_sizes:
                out.append(parse_encoding(f"{base}-g{g}{suffix}"))
        seen: dict[EncodingChoice, None] = {}
        for c in out:
            seen.setdefault(c, None)
        return list(seen)


@dataclass(frozen=True)
class FactorizeSpec:
    enabled: bool = False
    ranks: tuple[float, ...] = (0.25, 0.5)
    factor_encoding: str = "int8"


@dataclass(frozen=True)
class SearchSpec:
    target_bpw: float | None = None
    target_size: int | None = None
    latency_budget_ms: float | None = None
    lut: str | None = None
    method: str = "knapsack"
    probe: bool = True


@dataclass(frozen=True)
class CalibrationSpec:
    samples: int = 128
    min_tokens: int = 16
    max_tokens: int = 192
    file: str | None = None
    seed: int = 0


@dataclass(frozen=True)
class KVCachePolicy:
    keys: str = "int8"
    values: str = "int4"


@dataclass(frozen=True)
class EvalSpec:
    file: str | None = None
    ctx: int = 512
    chunks: int = 0


@dataclass(frozen=True)
class PrefixSpec:
    name: str
    text: str
    system: bool = False  # as --prefix-system: one value for every entry


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    merge: bool = False


@dataclass(frozen=True)
class Recipe:
    quantize: QuantizeSpec = field(default_factory=QuantizeSpec)
    factorize: FactorizeSpec = field(default_factory=FactorizeSpec)
    protect: tuple[tuple[str, str], ...] = ()
    search: SearchSpec = field(default_factory=SearchSpec)
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)
    kv_cache: KVCachePolicy = field(default_factory=KVCachePolicy)
    prefixes: tuple[PrefixSpec, ...] = ()
    adapters: tuple[AdapterSpec, ...] = ()
    evaluation: EvalSpec = field(default_factory=EvalSpec)

    def protected(self, name: str) -> EncodingChoice | None:
        """The fixed encoding of tensor ``name`` (first matching pattern), or None."""
        for pattern, enc in self.protect:
            if re.fullmatch(pattern, name):
                return parse_encoding(enc)
        return None

    def with_budget(
        self,
        target_bpw: float | None = None,
        target_size: int | None = None,
        latency_budget_ms: float | None = None,
        lut: str | None = None,
    ) -> Recipe:
        """Command-line budgets override the recipe's (a size given replaces a bpw)."""
        s = self.search
        if target_bpw is not None or target_size is not None:
            s = replace(s, target_bpw=target_bpw, target_size=target_size)
        if latency_budget_ms is not None:
            s = replace(s, latency_budget_ms=latency_budget_ms)
        if lut is not None:
            s = replace(s, lut=lut)
        _check_search(s)
        return replace(self, search=s)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able view (stored in the package's provenance)."""

        def conv(obj: Any) -> Any:
            if hasattr(obj, "__dataclass_fields__"):
                return {f.name: conv(getattr(obj, f.name)) for f in fields(obj)}
            if isinstance(obj, tuple):
                return [conv(x) for x in obj]
            return obj

        out = conv(self)
        out["protect"] = dict(self.protect)
        del out["evaluation"]  # measures the package, does not make it: not provenance
        return out


def load_recipe(path: str | Path | None) -> Recipe:
    """Read a TOML recipe (None: the defaults)."""
    if path is None:
        return Recipe()
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise RecipeError(f"cannot read recipe {p}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise RecipeError(f"{p.name}: not valid TOML: {exc}") from None
    return parse_recipe(data, where=p.name)


def parse_recipe(data: dict[str, Any], where: str = "recipe") -> Recipe:
    """Validate a recipe already parsed from TOML (or built in code)."""
    known = {"quantize", "factorize", "protect", "search", "calibration", "kv_cache"}
    known |= {"prefixes", "adapters", "eval"}
    _no_unknown(data, known, where)
    q = _section(data, "quantize", QuantizeSpec, where)
    f = _section(data, "factorize", FactorizeSpec, where)
    s = _section(data, "search", SearchSpec, where)
    c = _section(data, "calibration", CalibrationSpec, where)
    kv = _section(data, "kv_cache", KVCachePolicy, where)
    protect = data.get("protect", dict(Recipe().protect))
    if not isinstance(protect, dict):
        raise RecipeError(f"{where}: [protect] must map regexes to encodings")
    prefixes = tuple(_items(data, "prefixes", PrefixSpec, where))
    adapters = tuple(_items(data, "adapters", AdapterSpec, where))
    ev = _section(data, "eval", EvalSpec, where)
    recipe = Recipe(q, f, tuple(protect.items()), s, c, kv, prefixes, adapters, ev)
    _validate(recipe, where)
    return recipe


def _no_unknown(table: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {', '.join(unknown)}")


def _section(data: dict[str, Any], key: str, cls: type, where: str) -> Any:
    table = data.get(key, {})
    if not isinstance(table, dict):
        raise RecipeError(f"{where}: [{key}] must be a table")
    return _build(table, cls, f"{where} [{key}]")


def _items(data: dict[str, Any], key: str, cls: type, where: str) -> list[Any]:
    items = data.get(key, [])
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise RecipeError(f"{where}: [[{key}]] must be an array of tables")
    return [_build(i, cls, f"{where} [[{key}]] #{n}") for n, i in enumerate(items)]


def _build(table: dict[str, Any], cls: type, where: str) -> Any:
    spec = {f.name: f for f in fields(cls)}
    _no_unknown(table, set(spec), where)
    kwargs: dict[str, Any] = {}
    defaults = cls.__dataclass_fields__
    for name, value in table.items():
        default = defaults[name].default
        kwargs[name] = _coerce(value, default, f"{where} {name}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required key missing
        raise RecipeError(f"{where}: {exc}") from None


def _coerce(value: Any, default: Any, where: str) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise RecipeError(f"{where}: expected true/false, got {value!r}")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, list):
            raise RecipeError(f"{where}: expected an array, got {value!r}")
        kind = type(default[0]) if default else None
        out = []
        for v in value:
            if kind is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if kind is not None and not isinstance(v, kind):
                raise RecipeError(f"{where}: expected {kind.__name__} items, got {v!r}")
            out.append(v)
        return tuple(out)
    if isinstance(default, float) or default is None:
        if isinstance(value, bool):
            raise RecipeError(f"{where}: expected a number or string, got {value!r}")
        if default is None and isinstance(value, (int, float, str)):
            return value
        if isinstance(value, (int, float)):
            return float(value)
        raise RecipeError(f"{where}: expected a number, got {value!r}")
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{where}: expected an integer, got {value!r}")
        return value
    if isinstance(default, str) or default is not None:
        if not isinstance(value, str):
            raise RecipeError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _check_search(s: SearchSpec) -> None:
    if s.target_bpw is not None and s.target_size is not None:
        raise RecipeError("give a target bits per weight or a target size, not both")
    if s.target_bpw is not None and not (
        isinstance(s.target_bpw, (int, float)) and 0.5 < s.target_bpw <= 32
    ):
        raise RecipeError(f"target_bpw must be in (0.5, 32], got {s.target_bpw!r}")
    if s.target_size is not None and not (isinstance(s.target_size, int) and s.target_size > 0):
        raise RecipeError(f"target_size must be a positive number of bytes, got {s.target_size!r}")
    if s.latency_budget_ms is not None:
        if not isinstance(s.latency_budget_ms, (int, float)) or s.latency_budget_ms < 0:
            raise RecipeError(f"latency_budget_ms must be >= 0, got {s.latency_budget_ms!r}")
    if s.method not in SEARCH_METHODS:
        raise RecipeError(f"search method must be one of {SEARCH_METHODS}, got {s.method!r}")


def _validate(r: Recipe, where: str) -> None:
    q = r.quantize
    if not q.encodings:
        raise RecipeError(f"{where}: [quantize] encodings is empty")
    for kind in q.encodings:
        if kind not in _KINDS:
            try:
                parse_encoding(kind)
            except ValueError as exc:
                if by_label(kind) is not None:  # a label whose group size is not written
                    raise RecipeError(f"{where}: [quantize] encodings: {exc}") from None
                raise RecipeError(
                    f"{where}: unknown encoding {kind!r} (kinds: {', '.join(_KINDS)}, "
                    "or a full label such as int4-g64-asym)"
                ) from None
    for g in q.group_sizes:
        try:
            check_group_size(g)
        except ValueError as exc:
            raise RecipeError(f"{where}: [quantize] group_sizes: {exc}") from None
    if q.algorithm not in ALGORITHMS:
        raise RecipeError(f"{where}: algorithm must be one of {ALGORITHMS}, got {q.algorithm!r}")
    if not 0 <= q.damp < 1:
        raise RecipeError(f"{where}: damp must be in [0, 1), got {q.damp}")
    if q.block_size < 1:
        raise RecipeError(f"{where}: block_size must be positive")
    if not 0 <= q.smoothquant <= 1:
        raise RecipeError(f"{where}: smoothquant alpha must be in [0, 1], got {q.smoothquant}")
    f = r.factorize
    if any(not 0 < x <= 1 for x in f.ranks):
        raise RecipeError(f"{where}: factorize ranks are fractions in (0, 1]")
    _label(f.factor_encoding, f"{where}: factor_encoding")
    for pattern, enc in r.protect:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise RecipeError(f"{where}: bad protect regex {pattern!r}: {exc}") from None
        if not isinstance(enc, str):
            raise RecipeError(f"{where}: protect {pattern!r} must name an encoding")
        _label(enc, f"{where}: protect {pattern!r}")
    _check_search(r.search)
    c = r.calibration
    if not 1 <= c.samples <= 4096:
        raise RecipeError(f"{where}: calibration samples must be in 1..4096")
    if not 2 <= c.min_tokens <= c.max_tokens:
        raise RecipeError(f"{where}: need 2 <= min_tokens <= max_tokens")
    if r.evaluation.ctx < 4 or r.evaluation.chunks < 0:
        raise RecipeError(f"{where}: [eval] needs ctx >= 4 and chunks >= 0")
    if r.kv_cache.keys not in ("int8", "f16", "f32"):
        raise RecipeError(f"{where}: kv_cache keys must be int8, f16 or f32")
    if r.kv_cache.values not in ("int4", "int8", "f16", "f32"):
        raise RecipeError(f"{where}: kv_cache values must be int4, int8, f16 or f32")
    if len({p.system for p in r.prefixes}) > 1:
        raise RecipeError(f"{where}: [[prefixes]] are all system prompts or none (system)")
    if any(not p.text for p in r.prefixes):
        raise RecipeError(f"{where}: a [[prefixes]] text is empty")
    names = [p.name for p in r.prefixes] + [a.name for a in r.adapters]
    if len(set(names)) != len(names) or any(not n for n in names):
        raise RecipeError(f"{where}: prefix and adapter names must be unique and non-empty")


def _label(text: str, where: str) -> EncodingChoice:
    try:
        choice = parse_encoding(text)
    except ValueError as exc:
        raise RecipeError(f"{where}: {exc}") from None
    if choice.encoding == Encoding.LOW_RANK:
        raise RecipeError(f"{where}: low_rank is chosen by the search, not fixed")
    return choice

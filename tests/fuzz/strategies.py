"""Fuzz inputs built from the msgspec struct definitions, and the checks on what comes out.

:class:`Shape` reads a struct's fields with ``msgspec.inspect`` and draws a
valid encoding of it (a value for every field, inside every declared bound,
the bounds themselves included), then mutates it in three layers:

* fields: a required one dropped, one set to a value its type forbids (one
  past a bound, a near miss of a pattern, another msgpack kind), an unknown
  one added, the tag changed, the order shuffled, a header widened;
* the msgpack tree: any node's header announcing another length, replaced by
  another value, an extension or raw bytes, deleted, repeated, or buried in
  thousands of nested arrays;
* the bytes: cut, flipped, inserted, deleted.

Each :class:`Case` says what the decoder must do: ``ok`` (decode to exactly
the tree), ``error`` (refuse) or ``any`` (either, but only with GPUMesh's own
errors). A new message type, field or bound is fuzzed without touching this
file; a field type it cannot draw yet fails loudly (see :func:`values`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st

from tests.fuzz.mpack import U32_MAX, Ext, Lie, Nest, Pairs, Raw, Wide, pack, plain

__all__ = [
    "ANY",
    "ERROR",
    "OK",
    "Case",
    "Shape",
    "any_values",
    "expected",
    "invalid_values",
    "mutate_bytes",
    "mutate_tree",
    "one_in",
    "register_tags",
    "same",
    "values",
    "violations",
]

OK, ERROR, ANY = "ok", "error", "any"
I64_MIN = -(2**63)
U64_MAX = 2**64 - 1
EDGE_COUNTS = (0, 1, 15, 16, 31, 32, 255, 256, 65535, 65536, 2**31 - 1, 2**31, U32_MAX)
NEST_DEPTHS = (1, 2, 64, 500, 900, 999, 1000, 1001, 1200, 1400, 1500, 5000, 50_000)
LONG_LIST = 4096
"""Longest list drawn at a bound (longer bounds are only drawn small)."""


@cache
def one_in(n: int) -> st.SearchStrategy[bool]:
    """True once in ``n`` draws, about; False is the simpler value, for shrinking."""
    return st.sampled_from([False] * (n - 1) + [True])


# --- values from types -------------------------------------------------------------------


def _int_bounds(t: mi.IntType) -> tuple[int, int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else I64_MIN)
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else U64_MAX)
    return max(lo, I64_MIN), min(hi, U64_MAX)


def _float_bounded(t: mi.FloatType) -> bool:
    return any(bound is not None for bound in (t.ge, t.gt, t.le, t.lt))


@cache
def any_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """Arbitrary msgpack trees (what a peer may put in a field we do not know)."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(I64_MIN, U64_MAX)
        | st.floats()
        | st.text(max_size=16)
        | st.binary(max_size=16)
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=max_leaves,
    )


def values(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values a decoder of ``t`` must accept, bounds included."""
    if isinstance(t, mi.Metadata):
        return values(t.type)
    if isinstance(t, mi.AnyType):
        return any_values()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.IntType):
        lo, hi = _int_bounds(t)
        edges = sorted({lo, hi, min(max(lo, 0), hi)})
        ints = st.integers(lo, hi) | st.sampled_from(edges)
        if t.multiple_of:
            ints = ints.filter(lambda n: n % t.multiple_of == 0)
        return ints
    if isinstance(t, mi.FloatType):
        return st.floats(
            min_value=t.ge if t.ge is not None else t.gt,
            max_value=t.le if t.le is not None else t.lt,
            exclude_min=t.gt is not None,
            exclude_max=t.lt is not None,
            allow_nan=not _float_bounded(t),
        )
    if isinstance(t, mi.StrType):
        return _str_values(t)
    if isinstance(t, mi.BytesType):
        lo, hi = t.min_length or 0, t.max_length
        small = st.binary(min_size=lo, max_size=max(lo, min(hi if hi is not None else 48, 48)))
        return small | st.just(bytes(hi)) if hi is not None else small
    if isinstance(t, mi.ListType):
        return _list_values(t)
    if isinstance(t, mi.DictType):
        lo, hi = t.min_length or 0, t.max_length
        return st.dictionaries(
            values(t.key_type),
            values(t.value_type),
            min_size=lo,
            max_size=max(lo, min(hi if hi is not None else 4, 4)),
        )
    if isinstance(t, mi.UnionType):
        return st.one_of([values(member) for member in t.types])
    if isinstance(t, mi.StructType):
        return Shape(t.cls).valid()
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.EnumType):
        return st.sampled_from([member.value for member in t.cls])
    raise TypeError(f"the fuzzer cannot draw a {t!r} yet: teach tests/fuzz/strategies.py")


def _str_values(t: mi.StrType) -> st.SearchStrategy[str]:
    lo, hi = t.min_length or 0, t.max_length
    if t.pattern is not None:
        return st.from_regex(t.pattern, fullmatch=True).filter(
            lambda s: lo <= len(s) <= (hi if hi is not None else len(s))
        )
    small = st.text(min_size=lo, max_size=max(lo, min(hi if hi is not None else 24, 24)))
    if hi is None:
        return small
    # Bounds count characters: two- and four-byte ones put the encoded size far past them.
    return small | st.sampled_from(["x" * hi, "é" * hi, "\U0001f600" * hi, "x" * lo])


def _list_values(t: mi.ListType) -> st.SearchStrategy[list[Any]]:
    lo, hi = t.min_length or 0, t.max_length
    item = values(t.item_type)
    small = st.lists(item, min_size=lo, max_size=max(lo, min(hi if hi is not None else 4, 4)))
    if hi is not None and 4 < hi <= LONG_LIST:
        # At the bound, repeat one small item: large ones only make large inputs slowly.
        return small | item.filter(lambda x: len(pack(x)) <= 256).map(lambda x: [x] * hi)
    return small


# Representatives of each msgpack kind, and which kinds a type accepts.
_KINDS: dict[str, Any] = {
    "nil": None,
    "bool": True,
    "int": 7,
    "float": 1.5,
    "str": "x",
    "bin": b"x",
    "array": [],
    "map": {},
    "ext": Ext(5, b"x"),
}


def _accepted(t: mi.Type) -> set[str]:
    if isinstance(t, mi.Metadata):
        return _accepted(t.type)
    if isinstance(t, mi.AnyType):
        return set(_KINDS)
    if isinstance(t, mi.UnionType):
        return set().union(*(_accepted(member) for member in t.types))
    if isinstance(t, mi.LiteralType | mi.EnumType):
        options = t.values if isinstance(t, mi.LiteralType) else [m.value for m in t.cls]
        return {"str" if isinstance(v, str) else "int" for v in options}
    if isinstance(t, mi.StructType):
        return {"array"} if t.array_like else {"map"}
    simple: dict[type[mi.Type], set[str]] = {
        mi.NoneType: {"nil"},
        mi.BoolType: {"bool"},
        mi.IntType: {"int"},
        mi.FloatType: {"int", "float"},
        mi.StrType: {"str"},
        mi.BytesType: {"bin"},
        mi.ListType: {"array"},
        mi.DictType: {"map"},
    }
    return simple.get(type(t), set(_KINDS))


def invalid_values(t: mi.Type) -> st.SearchStrategy[Any] | None:
    """Values a decoder of ``t`` must refuse, or None when there are none to draw."""
    if isinstance(t, mi.Metadata):
        return invalid_values(t.type)
    options: list[st.SearchStrategy[Any]] = []
    wrong = [value for kind, value in _KINDS.items() if kind not in _accepted(t)]
    if wrong:
        options.append(st.sampled_from(wrong))
    if isinstance(t, mi.IntType):
        lo, hi = _int_bounds(t)
        if lo > I64_MIN:
            options.append(st.integers(I64_MIN, lo - 1) | st.just(lo - 1))
        if hi < U64_MAX:
            options.append(st.integers(hi + 1, U64_MAX) | st.just(hi + 1))
    elif isinstance(t, mi.FloatType):
        if _float_bounded(t):
            options.append(st.just(math.nan))
        if t.ge is not None:
            options.append(st.just(math.nextafter(t.ge, -math.inf)) | st.just(-math.inf))
        if t.gt is not None:
            options.append(st.just(float(t.gt)))
        if t.le is not None:
            options.append(st.just(math.nextafter(t.le, math.inf)) | st.just(math.inf))
        if t.lt is not None:
            options.append(st.just(float(t.lt)))
    elif isinstance(t, mi.StrType):
        if t.max_length is not None:
            options.append(st.sampled_from(["x", "é"]).map(lambda c: c * (t.max_length + 1)))
        if t.min_length:
            options.append(st.just("x" * (t.min_length - 1)))
        if t.pattern is not None:
            pattern = re.compile(t.pattern)
            near = values(t).flatmap(
                lambda s: st.sampled_from([s + "\n", "\n" + s, s + "\x00", " " + s, s[:-1]])
            )
            options.append(near.filter(lambda s: pattern.fullmatch(s) is None))
    elif isinstance(t, mi.BytesType):
        if t.max_length is not None:
            options.append(st.just(bytes(t.max_length + 1)))
        if t.min_length:
            options.append(st.just(bytes(t.min_length - 1)))
    elif isinstance(t, mi.ListType):
        item = values(t.item_type)
        if t.max_length is not None and t.max_length < LONG_LIST:
            small = item.filter(lambda x: len(pack(x)) <= 256)
            options.append(small.map(lambda x: [x] * (t.max_length + 1)))
        if t.min_length:
            options.append(item.map(lambda x: [x] * (t.min_length - 1)))
    elif isinstance(t, mi.StructType):
        if any(field.required for field in t.fields):
            options.append(st.just([] if t.array_like else {}))
    elif isinstance(t, mi.LiteralType):
        options.append(st.just("\x00not-a-literal"))
    return st.one_of(options) if options else None


# --- cases -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One input for a decoder and what the decoder must do with it."""

    tree: Any
    """The value tree before the byte mutations (what ``ok`` must decode to)."""
    data: bytes
    expect: str
    """``ok``, ``error`` or ``any``."""
    steps: tuple[str, ...]
    """The mutations applied, in order."""

    def __repr__(self) -> str:
        shown = self.data if len(self.data) <= 1024 else self.data[:1024] + b"..."
        return (
            f"Case(expect={self.expect!r}, steps={self.steps!r}, {len(self.data)} bytes={shown!r})"
        )


def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    node = tree.value if isinstance(tree, Wide) else tree
    if isinstance(node, dict):
        for key, item in node.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(node, list):
        for index, item in enumerate(node[:64]):
            found += _paths(item, (*prefix, index))
    return found


def _replace(tree: Any, path: tuple[Any, ...], change: Any) -> Any:
    if not path:
        return change(tree)
    if isinstance(tree, Wide):
        return Wide(_replace(tree.value, path, change))
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        new_map = dict(tree)
        new_map[head] = _replace(tree[head], rest, change)
        return new_map
    new_list = list(tree)
    new_list[head] = _replace(tree[head], rest, change)
    return new_list


def _without(parent: Any, key: Any) -> Any:
    if isinstance(parent, Wide):
        return Wide(_without(parent.value, key))
    if isinstance(parent, dict):
        return {k: v for k, v in parent.items() if k != key}
    return parent[:key] + parent[key + 1 :]


def _repeated(parent: Any, key: Any, other: Any) -> Any:
    if isinstance(parent, Wide):
        return Wide(_repeated(parent.value, key, other))
    if isinstance(parent, dict):
        return Pairs((*parent.items(), (key, other)))
    return [*parent[: key + 1], other, *parent[key + 1 :]]


def _size(node: Any) -> int | None:
    inner = node.value if isinstance(node, Wide | Lie) else node
    if isinstance(inner, str):
        return len(inner.encode("utf-8", "surrogatepass"))
    if isinstance(inner, bytes | list | dict):
        return len(inner)
    return None


_TREE_OPS = st.sampled_from(["lie", "value", "delete", "repeat", "nest", "raw", "ext", "blob"])
_BYTE_OPS = st.sampled_from(["cut", "flip", "insert", "delete", "append"])
# What a newer peer might add: anything, deeply nested arrays included (skipping
# an unknown value is where a decoder recurses without a field type to stop it).
_UNKNOWN = any_values(4) | st.builds(Nest, any_values(1), st.sampled_from(NEST_DEPTHS))
_EXTRAS = st.lists(_UNKNOWN, min_size=1, max_size=3)
_NAMES = st.text(max_size=12)


@st.composite
def mutate_tree(draw: st.DrawFn, tree: Any, blob_sizes: tuple[int, ...]) -> tuple[Any, str]:
    """One generic change anywhere in the tree; the result's validity is unknown."""
    path = draw(st.sampled_from(_paths(tree)))
    op = draw(_TREE_OPS)
    where = "/".join(map(str, path)) or "root"
    if op == "lie":
        node: Any = tree
        for key in path:
            node = (node.value if isinstance(node, Wide) else node)[key]
        real = _size(node)
        if real is None:
            op = "value"
        else:
            count = draw(
                st.sampled_from(EDGE_COUNTS)
                | st.integers(-3, 3).map(lambda d: max(real + d, 0))
                | st.integers(0, U32_MAX)
            )
            return _replace(tree, path, lambda n: Lie(n, count)), f"lie {where} {real}->{count}"
    if op in ("delete", "repeat") and path:
        parent, key = path[:-1], path[-1]
        if op == "delete":
            return _replace(tree, parent, lambda p: _without(p, key)), f"delete {where}"
        other = draw(any_values(4))
        return _replace(tree, parent, lambda p: _repeated(p, key, other)), f"repeat {where}"
    if op == "nest":
        depth = draw(st.sampled_from(NEST_DEPTHS))
        return _replace(tree, path, lambda n: Nest(n, depth)), f"nest {where} {depth}"
    if op == "raw":
        raw = Raw(draw(st.binary(min_size=1, max_size=9)))
        return _replace(tree, path, lambda _: raw), f"raw {where} {raw.data!r}"
    if op == "ext":
        ext = Ext(draw(st.integers(-128, 127)), draw(st.binary(max_size=17)))
        return _replace(tree, path, lambda _: ext), f"ext {where} {ext.code}/{len(ext.data)}"
    if op == "blob":
        size = draw(st.sampled_from(blob_sizes))
        blob = draw(st.sampled_from([bytes(size), "x" * size]))
        return _replace(tree, path, lambda _: blob), f"blob {where} {size}"
    other = draw(any_values())
    return _replace(tree, path, lambda _: other), f"value {where} {other!r:.60}"


@st.composite
def mutate_bytes(draw: st.DrawFn, data: bytes) -> tuple[bytes, str]:
    """One change to encoded bytes: cut, flip, insert, delete or append."""
    op = draw(_BYTE_OPS)
    if not data:
        op = "append"
    at = draw(st.integers(0, max(len(data) - 1, 0)))
    if op == "cut":
        return data[:at], f"cut at {at}"
    if op == "flip":
        bit = draw(st.integers(1, 255))
        return data[:at] + bytes([data[at] ^ bit]) + data[at + 1 :], f"flip {at} ^{bit:#x}"
    extra = draw(st.binary(min_size=1, max_size=8))
    if op == "insert":
        return data[:at] + extra + data[at:], f"insert {extra!r} at {at}"
    if op == "delete":
        end = draw(st.integers(at + 1, min(len(data), at + 16)))
        return data[:at] + data[end:], f"delete {at}:{end}"
    return data + extra, f"append {extra!r}"


class Shape:
    """The fuzzing view of one msgspec struct: valid trees and mutated cases of it.

    ``overrides`` draws chosen fields from a given strategy instead of their
    type (a key the test can sign with, a plausible expiry time); ``blob_sizes``
    are the sizes of the oversized strings a mutation may plant, chosen around
    the decoder's input limit.
    """

    def __init__(
        self,
        cls: type[msgspec.Struct],
        *,
        overrides: dict[str, st.SearchStrategy[Any]] | None = None,
        blob_sizes: tuple[int, ...] = (1024,),
    ) -> None:
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        self.cls = cls
        self.info = info
        self.fields = info.fields
        self.blob_sizes = blob_sizes
        overrides = overrides or {}
        self.draws = {
            f.name: overrides[f.name] if f.name in overrides else values(f.type)
            for f in info.fields
        }
        self.invalid = {f.name: invalid_values(f.type) for f in info.fields}
        self.known = {f.encode_name for f in info.fields} | {info.tag_field}
        # Required fields come first in an array-like struct; the rest may be left off.
        self.required = sum(1 for f in info.fields if f.required)

    def valid(self) -> st.SearchStrategy[Any]:
        """Valid trees: a dict (a list for array-like structs) of plain values."""
        return _valid_tree(self)

    def cases(self) -> st.SearchStrategy[Case]:
        return _case(self)


@st.composite
def _valid_tree(draw: st.DrawFn, shape: Shape) -> Any:
    if shape.info.array_like:
        cut = draw(st.integers(shape.required, len(shape.fields)))
        return [draw(shape.draws[f.name]) for f in shape.fields[:cut]]
    tree: dict[str, Any] = {}
    if shape.info.tag_field is not None:
        tree[shape.info.tag_field] = shape.info.tag
    for f in shape.fields:
        if f.required or draw(st.booleans()):
            tree[f.encode_name] = draw(shape.draws[f.name])
    return tree


@st.composite
def _case(draw: st.DrawFn, shape: Shape) -> Case:
    mutator = _FieldMutator(shape, draw)
    tree = draw(shape.valid())
    steps = []
    for _ in range(draw(st.integers(0, 2))):
        tree = mutator.mutate(tree)
        steps.append(mutator.step)
    unknown = mutator.unknown
    for _ in range(draw(st.integers(0, 2))):
        tree, step = draw(mutate_tree(tree, shape.blob_sizes))
        steps.append(step)
        unknown = True
    data = pack(tree)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        data, step = draw(mutate_bytes(data))
        steps.append(step)
        unknown = True
    expect = ANY if unknown else ERROR if mutator.errors else OK
    return Case(tree, data, expect, tuple(steps))


class _FieldMutator:
    """Field-aware changes, remembering which of them make the struct invalid."""

    def __init__(self, shape: Shape, draw: st.DrawFn) -> None:
        self.shape = shape
        self.draw = draw
        self.errors: set[str] = set()
        """Why the tree is invalid now: bad or missing fields, forbidden extras."""
        self.unknown = False
        """Whether a change made the outcome unpredictable."""
        self.step = ""

    def mutate(self, tree: Any) -> Any:
        if isinstance(tree, Wide):
            return Wide(self.mutate(tree.value))
        ops = ["invalid", "unknown", "wide", "wide-all", "drop"]
        ops += ["retag", "reorder"] if self.shape.info.tag_field is not None else []
        op = self.draw(st.sampled_from(ops))
        if op == "wide-all":
            self.step = "wide root"
            return Wide(tree)
        if self.shape.info.array_like:
            return self._array(tree, op)
        return self._map(tree, op)

    def _array(self, tree: list[Any], op: str) -> list[Any]:
        draw, fields = self.draw, self.shape.fields
        if op == "drop":
            keep = draw(st.integers(0, len(tree)))
            self.errors = {e for e in self.errors if not e.startswith("[") or int(e[1:-1]) < keep}
            if keep < len(fields):
                self.errors.discard("extra")
            if keep < self.shape.required:
                self.errors.add("missing")
            self.step = f"keep {keep}"
            return tree[:keep]
        if op == "unknown":
            extra = draw(_EXTRAS)
            if len(tree) < len(fields) or any(isinstance(x, Nest) for x in extra):
                # The extras fill optional fields, or nest deeper than a decoder goes.
                self.unknown = True
            elif self.shape.info.forbid_unknown_fields:
                self.errors.add("extra")
            self.step = f"append {len(extra)}"
            return [*tree, *extra]
        present = min(len(tree), len(fields))
        if not present:
            self.step = "none"
            return tree
        index = draw(st.integers(0, present - 1))
        if op == "wide":
            self.step = f"wide [{index}]"
            return _replace(tree, (index,), Wide)
        bad = self.shape.invalid[fields[index].name]
        if op != "invalid" or bad is None:
            self.step = "none"
            return tree
        value = draw(bad)
        self.errors.add(f"[{index}]")
        self.step = f"invalid [{index}] {value!r:.60}"
        return _replace(tree, (index,), lambda _: value)

    def _map(self, tree: dict[str, Any], op: str) -> dict[str, Any]:
        draw, info = self.draw, self.shape.info
        if op == "unknown":
            name = draw(_NAMES)
            if name in self.shape.known:
                name += "\x00"
            if info.forbid_unknown_fields:
                self.errors.add(f"unknown {name}")
            value = draw(_UNKNOWN)
            self.unknown |= isinstance(value, Nest)  # refusing deep nesting is fine
            self.step = f"unknown {name!r}"
            return {**tree, name: value}
        if op == "retag":
            tag = draw(_tags())
            self.unknown = True
            self.step = f"retag {tag!r}"
            return {**tree, info.tag_field: tag}
        if op == "reorder":
            self.step = "reorder"
            return dict(draw(st.permutations(list(tree.items()))))
        if not self.shape.fields:
            self.step = "none"
            return tree
        field = draw(st.sampled_from(self.shape.fields))
        name = field.encode_name
        if op == "drop":
            self.errors.discard(name)
            if field.required:
                self.errors.add(f"missing {name}")
            self.step = f"drop {name}"
            return {k: v for k, v in tree.items() if k != name}
        if op == "wide":
            self.step = f"wide {name}"
            return {**tree, name: Wide(tree[name])} if name in tree else tree
        bad = self.shape.invalid[field.name]
        if bad is None:
            self.step = "none"
            return tree
        value = draw(bad)
        self.errors.discard(f"missing {name}")
        self.errors.add(name)
        self.step = f"invalid {name} {value!r:.60}"
        return {**tree, name: value}


_TAGS: list[str] = []


def register_tags(tags: set[str]) -> None:
    """Tags a retag mutation may switch to (every message type's)."""
    _TAGS[:] = sorted(set(_TAGS) | tags)
    _tags.cache_clear()


@cache
def _tags() -> st.SearchStrategy[str]:
    return st.text(max_size=16) | st.sampled_from(_TAGS or ["x"])


# --- checks on what comes out ------------------------------------------------------------


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value, builtin_types=(bytes, bytearray))


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def same(a: Any, b: Any) -> bool:
    """Whether two decoded values are equal, NaN included."""
    return _equal(_builtins(a), _builtins(b))


def expected(case: Case, cls: type[msgspec.Struct]) -> Any:
    """What an ``ok`` case must decode to."""
    return msgspec.convert(plain(case.tree), cls)


def violations(value: Any, t: mi.Type, where: str = "$") -> list[str]:
    """Where a decoded value breaks a bound its type declares (patterns must match in full)."""
    if isinstance(t, mi.Metadata):
        return violations(value, t.type, where)
    if isinstance(t, mi.UnionType):
        found: list[str] = []
        for member in t.types:
            if _python_type_fits(value, member):
                problems = violations(value, member, where)
                if not problems:
                    return []
                found = problems
        return found or [f"{where}: {type(value).__name__} fits no member of {t!r}"]
    if not _python_type_fits(value, t):
        return [f"{where}: got a {type(value).__name__} for {t!r}"]
    if isinstance(t, mi.StrType | mi.BytesType):
        problems = _length(value, t.min_length, t.max_length, where)
        if isinstance(t, mi.StrType) and t.pattern and not re.fullmatch(t.pattern, value):
            problems.append(f"{where}: {value!r:.80} does not fully match {t.pattern!r}")
        return problems
    if isinstance(t, mi.IntType | mi.FloatType):
        return _range(value, t, where)
    if isinstance(t, mi.ListType):
        problems = _length(value, t.min_length, t.max_length, where)
        for index, item in enumerate(value):
            problems += violations(item, t.item_type, f"{where}[{index}]")
        return problems
    if isinstance(t, mi.DictType):
        problems = _length(value, t.min_length, t.max_length, where)
        for key, item in value.items():
            problems += violations(key, t.key_type, f"{where}.key")
            problems += violations(item, t.value_type, f"{where}[{key!r:.40}]")
        return problems
    if isinstance(t, mi.StructType):
        problems = []
        for field in t.fields:
            problems += violations(getattr(value, field.name), field.type, f"{where}.{field.name}")
        return problems
    if isinstance(t, mi.LiteralType) and value not in t.values:
        return [f"{where}: {value!r} is not one of {t.values!r}"]
    return []


def _python_type_fits(value: Any, t: mi.Type) -> bool:
    if isinstance(t, mi.Metadata):
        return _python_type_fits(value, t.type)
    if isinstance(t, mi.NoneType):
        return value is None
    if isinstance(t, mi.BoolType):
        return isinstance(value, bool)
    if isinstance(t, mi.IntType):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(t, mi.FloatType):
        return isinstance(value, float)
    if isinstance(t, mi.StrType):
        return isinstance(value, str)
    if isinstance(t, mi.BytesType):
        return isinstance(value, bytes)
    if isinstance(t, mi.ListType):
        return isinstance(value, list)
    if isinstance(t, mi.DictType):
        return isinstance(value, dict)
    if isinstance(t, mi.StructType):
        return isinstance(value, t.cls)
    return True


def _length(value: Any, lo: int | None, hi: int | None, where: str) -> list[str]:
    if lo is not None and len(value) < lo:
        return [f"{where}: length {len(value)} under {lo}"]
    if hi is not None and len(value) > hi:
        return [f"{where}: length {len(value)} over {hi}"]
    return []


def _range(value: float, t: mi.IntType | mi.FloatType, where: str) -> list[str]:
    ok = (
        (t.ge is None or value >= t.ge)
        and (t.gt is None or value > t.gt)
        and (t.le is None or value <= t.le)
        and (t.lt is None or value < t.lt)
    )
    return [] if ok else [f"{where}: {value!r} out of bounds of {t!r}"]

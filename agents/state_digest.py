"""A canonical digest of an object graph (the scheduler's state), and where two graphs first differ.

Two states that are equal field by field -- whatever order their dicts and sets were built in, whatever the process's
hash seed -- have the same digest; the same rule as tests/test_scheduler_snapshot.canonical (sets and dicts compared
regardless of order, functools.cached_property memos and pydantic's bookkeeping left out), computed in one pass: every
container and object is hashed once (BLAKE2b, 16 bytes) and memoised by identity, so an object shared by several
parts of the state (a job record in the job table and in the nominations) costs one visit. Pure: no I/O.

Used by the segmented audit (agents/audit_segments.py): the state a segment's replay derives must have the digest of
the snapshot recorded at its end.
"""
from __future__ import annotations

import enum
import functools
from array import array
from operator import is_ as _is
from hashlib import blake2b

_SKIP_SLOTS = frozenset({"__dict__", "__weakref__"})


@functools.lru_cache(maxsize=None)
def _layout(cls: type) -> tuple[tuple[str, ...], frozenset[str]]:
    """(slot names, names to leave out) of a class."""
    slots: list[str] = []
    for c in cls.__mro__:
        s = getattr(c, "__slots__", ())
        for name in (s,) if isinstance(s, str) else s:
            if name not in _SKIP_SLOTS and name not in slots:
                slots.append(name)
    memos = frozenset(n for c in cls.__mro__ for n, v in vars(c).items() if isinstance(v, functools.cached_property))
    return tuple(slots), memos


@functools.lru_cache(maxsize=None)
def _plain(cls: type) -> bool:
    """Whether an object's state is its __dict__ as it is (no slots of its own, no memos): pydantic models and
    ordinary classes; their __dict__ holds no pydantic bookkeeping."""
    slots, memos = _layout(cls)
    return not memos and all(n.startswith("__pydantic") for n in slots)


def fields(obj) -> dict:
    """An object's state: its __dict__ and slots, without memos of derived values and pydantic's bookkeeping."""
    cls = type(obj)
    if _plain(cls) and hasattr(obj, "__dict__"):
        return {k: v for k, v in obj.__dict__.items() if not k.startswith("__pydantic")}
    slots, memos = _layout(cls)
    out = {}
    d = getattr(obj, "__dict__", None)
    if d is not None:
        out.update(d)
    for name in slots:
        if hasattr(obj, name):
            out[name] = getattr(obj, name)
    return {k: v for k, v in out.items() if not (k.startswith("__pydantic") or k in memos)}


def _tag(text: str) -> bytes:
    b = text.encode()
    return b"%d:" % len(b) + b


class Digest:
    """enc(obj): a self-delimiting canonical encoding -- primitives literally, anything else as its 16-byte hash."""

    def __init__(self, keep: dict | None = None):
        self.memo: dict[int, bytes] = {}
        self.active: set[int] = set()
        self.objects = 0
        # `keep`: id -> (object, encoding) of deeply immutable objects (an immutable type whose every part is
        # immutable too), shared by the digests of one process: an object that cannot change has the same encoding
        # in a later pass, so the digest of a state after a replay re-encodes only what is new or mutable. It holds
        # each object it names, so an id in it is never reused by another object.
        self.keep = keep
        self.mutable: set[int] = set()  # ids in `memo` of objects that are, or hold, something mutable
        self.muts = 0  # mutable objects met so far (a part's count rising while its parent encodes: not immutable)

    def hex(self, obj) -> str:
        return self.enc(obj).hex()

    def enc(self, obj) -> bytes:
        t = type(obj)
        if t is str:
            b = obj.encode("utf-8", "surrogatepass")
            return b"s%d:" % len(b) + b
        if t is int:
            return b"i%d;" % obj
        if obj is None:
            return b"N"
        if t is bool:
            return b"T" if obj else b"F"
        if t is float:
            return b"f" + repr(obj).encode() + b";"
        if t is bytes:
            return b"b%d:" % len(obj) + obj
        i = id(obj)
        d = self.memo.get(i)
        if d is not None:
            if i in self.mutable:
                self.muts += 1
            return d
        keep = self.keep
        if keep is not None:
            k = keep.get(i)
            if k is not None and k[0] is obj:
                if len(k) == 2:
                    return k[1]
                # a mutable plain object whose fields were all immutable: the same encoding while it holds the
                # very same field objects (identity, never equality: 1 == 1.0 == True encode apart)
                f = obj.__dict__
                if type(obj) is k[4] and len(f) == len(k[2]) and all(map(_is, f, k[2])) \
                        and all(map(_is, f.values(), k[3])):
                    self.muts += 1
                    return k[1]
        if i in self.active:  # a reference back to an object being encoded (as `canonical`: its type only)
            self.muts += 1
            return b"c" + _tag(t.__qualname__)
        self.active.add(i)
        before = self.muts
        try:
            d = b"h" + blake2b(self.body(obj), digest_size=16).digest()
        finally:
            self.active.discard(i)
        self.memo[i] = d
        self.objects += 1
        if self.muts != before or not _immutable(t):
            if keep is not None and self.muts == before and _plain(t) and _is_object(t):
                f = getattr(obj, "__dict__", None)
                if f is not None:
                    keep[i] = (obj, d, tuple(f), tuple(f.values()), t)
            self.mutable.add(i)
            self.muts += 1
        elif keep is not None and t is not tuple:  # a tuple is re-encoded about as fast as it is looked up
            keep[i] = (obj, d)
        return d

    def _pairs(self, items) -> bytes:
        """The sorted encodings of (key, value) pairs: enc(k) + enc(v), the commonest primitives inline."""
        enc = self.enc
        out = []
        append = out.append
        keys = _KEYS
        for k, v in items:
            if type(k) is str:
                ek = keys.get(k)
                if ek is None:
                    b = k.encode("utf-8", "surrogatepass")
                    ek = b"s%d:" % len(b) + b
                    if len(keys) < 1 << 16:
                        keys[k] = ek
            else:
                ek = enc(k)
            t = type(v)
            if t is int:
                append(ek + b"i%d;" % v)
            elif t is str:
                b = v.encode("utf-8", "surrogatepass")
                append(ek + b"s%d:" % len(b) + b)
            elif v is None:
                append(ek + b"N")
            else:
                append(ek + enc(v))
        out.sort()
        return b"".join(out)

    def _fields(self, d: dict) -> bytes:
        """`_pairs` of an object's __dict__ (string keys), pydantic's bookkeeping left out."""
        enc = self.enc
        out = []
        append = out.append
        keys = _FIELDS
        for k, v in d.items():
            ek = keys.get(k)
            if ek is None:
                if type(k) is not str:
                    ek = enc(k)
                else:
                    b = k.encode("utf-8", "surrogatepass")
                    ek = b"" if k.startswith("__pydantic") else b"s%d:" % len(b) + b
                    if len(keys) < 1 << 16:
                        keys[k] = ek
            if not ek:
                continue
            t = type(v)
            if t is int:
                append(ek + b"i%d;" % v)
            elif t is str:
                b = v.encode("utf-8", "surrogatepass")
                append(ek + b"s%d:" % len(b) + b)
            elif v is None:
                append(ek + b"N")
            else:
                append(ek + enc(v))
        out.sort()
        return b"".join(out)

    def body(self, obj) -> bytes:
        enc = self.enc
        cls = type(obj)
        if cls is array:  # the claim standings' Fenwick trees: their items as machine words, not their repr
            return b"A" + obj.typecode.encode() + obj.tobytes()
        if cls in _OBJECTS or (cls not in _OTHERS and _is_object(cls)):
            d = getattr(obj, "__dict__", None)
            if d is not None and _plain(cls):
                if d:
                    return b"O" + _tag(cls.__qualname__) + self._fields(d)
            else:
                f = fields(obj)
                if f:
                    return b"O" + _tag(cls.__qualname__) + self._pairs(f.items())
            return b"R" + _tag(cls.__qualname__) + (b"" if callable(obj) else repr(obj).encode())
        name = _tag(cls.__qualname__)
        if isinstance(obj, enum.Enum):
            return b"E" + name + enc(obj.value)
        if isinstance(obj, (list, tuple)):
            return b"L" + name + b"".join(map(enc, obj))
        if isinstance(obj, dict):
            return b"D" + name + self._pairs(obj.items())
        if isinstance(obj, (set, frozenset)):
            return b"S" + name + b"".join(sorted(map(enc, obj)))
        if isinstance(obj, type):
            return b"t" + _tag(f"{obj.__module__}.{obj.__qualname__}")
        if isinstance(obj, (int, str, float, bytes)):  # subclasses of the primitives
            return b"P" + name + repr(obj).encode()
        f = fields(obj)
        if not f:
            return b"R" + name + (b"" if callable(obj) else repr(obj).encode())
        return b"O" + name + b"".join(sorted(enc(k) + enc(v) for k, v in f.items()))


_OBJECTS: set[type] = set()
_OTHERS: set[type] = set()
_KEYS: dict[str, bytes] = {}  # str key -> its encoding (field names, ids: the keys met most), bounded
_FIELDS: dict[str, bytes] = {}  # field name -> its encoding, b"" for pydantic's bookkeeping (left out), bounded


@functools.lru_cache(maxsize=None)
def _immutable(cls: type) -> bool:
    """Whether instances of a class cannot change once made: tuples, frozensets, enums, classes, the primitives'
    subclasses, frozen dataclasses, frozen pydantic models (their parts are checked apart, by `Digest.enc`)."""
    if issubclass(cls, (tuple, frozenset, enum.Enum, type, int, str, float, bytes)):
        return True
    params = getattr(cls, "__dataclass_params__", None)
    if params is not None and getattr(params, "frozen", False) and "__dataclass_fields__" in vars(cls):
        return True
    config = getattr(cls, "model_config", None)
    return isinstance(config, dict) and config.get("frozen") is True and hasattr(cls, "__pydantic_fields__")


def _is_object(cls: type) -> bool:
    """Whether instances are encoded by their fields (not an enum, container, class or primitive); remembered."""
    plain = not issubclass(cls, (enum.Enum, list, tuple, dict, set, frozenset, type, int, str, float, bytes))
    (_OBJECTS if plain else _OTHERS).add(cls)
    return plain


def digest(state, keep: dict | None = None) -> str:
    """The state's canonical digest (hex). `keep`: a dict shared by the digests of one process (see Digest): the
    encodings of the immutable parts met before are reused -- the same digest, sooner."""
    return Digest(keep).hex(state)


def parts(state) -> dict[str, str]:
    """The digest of the state and of each of its fields (one pass): {"": whole, "field": that field's}."""
    d = Digest()
    out = {"": d.hex(state)}
    for k, v in sorted(fields(state).items()):
        out[k] = d.hex(v)
    return out


def _children(obj, d: Digest) -> tuple[str, dict[bytes, tuple[str, object]]] | None:
    """(kind, {sort key: (label, child)}) of a container or object, None for a primitive."""
    if obj is None or type(obj) in (str, int, bool, float, bytes) or isinstance(obj, (enum.Enum, type)):
        return None
    if isinstance(obj, (list, tuple)):
        return "list", {b"%012d" % i: (f"[{i}]", x) for i, x in enumerate(obj)}
    if isinstance(obj, dict):
        return "dict", {d.enc(k): (f"[{k!r}]", v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return "set", {d.enc(x): (f"{{{x!r:.80}}}", x) for x in obj}
    f = fields(obj)
    return (type(obj).__qualname__, {k.encode(): (f".{k}", v) for k, v in f.items()}) if f else None


def first_difference(a, b, path: str = "state", da: Digest | None = None, db: Digest | None = None,
                     depth: int = 0) -> str | None:
    """Where two graphs first differ (in sorted order of keys and fields), as 'path: a != b'; None when equal."""
    da, db = da or Digest(), db or Digest()
    if da.enc(a) == db.enc(b):
        return None
    ca, cb = _children(a, da), _children(b, db)
    if ca is None or cb is None or ca[0] != cb[0] or depth > 60:
        return f"{path}: derived {a!r:.200} != recorded {b!r:.200}"
    (kind, xa), (_, xb) = ca, cb
    for key in sorted(set(xa) | set(xb)):
        if key not in xb:
            return f"{path}{xa[key][0]}: derived has it, recorded has not"
        if key not in xa:
            return f"{path}{xb[key][0]}: recorded has it, derived has not"
        got = first_difference(xa[key][1], xb[key][1], path + xa[key][0], da, db, depth + 1)
        if got:
            return got
    return f"{path}: differ ({kind}) but no part does"  # not reached for acyclic graphs

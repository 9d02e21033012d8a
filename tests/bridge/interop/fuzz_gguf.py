"""Damage for the import fuzzing test: seeded mutations of a GGUF export, by a small GGUF reader and writer
of its own (independent of the ``gguf`` package whose reader the importer uses). Each mutation is
``fn(directory, rng) -> str`` as in :mod:`interop.fuzz_helpers`."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

# GGUF value types: struct codes of the scalars; 8 = string, 9 = array
SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# ggml type -> (elements per block, bytes per block) for the types our exporter writes and a few others
BLOCK = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 30: (1, 2)}
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K", 30: "BF16", 39: "MXFP4"}


@dataclass
class Tensor:
    name: str
    dims: list
    type: int
    offset: int
    at: int = 0  # where its info starts in the file

    def nbytes(self) -> int:
        n = 1
        for x in self.dims:
            n *= x
        per, size = BLOCK.get(self.type, (1, 1))
        return n // per * size


@dataclass
class GGUF:
    version: int
    kvs: list  # [key, vtype, raw value bytes, value]
    tensors: list
    data_start: int
    raw: bytes
    infos_end: int = 0
    alignment: int = 32
    kv_at: dict = field(default_factory=dict)  # key -> where its value starts

    def kv(self, key):
        return next((v for k, _, _, v in self.kvs if k == key), None)


def _str(b, pos):
    n = struct.unpack_from("<Q", b, pos)[0]
    return b[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n


def _value(b, pos, vtype):
    if vtype in SCALAR:
        return struct.unpack_from("<" + SCALAR[vtype], b, pos)[0], pos + struct.calcsize(SCALAR[vtype])
    if vtype == 8:
        return _str(b, pos)
    if vtype == 9:
        itype, n = struct.unpack_from("<IQ", b, pos)
        pos += 12
        items = []
        for _ in range(n):
            v, pos = _value(b, pos, itype)
            items.append(v)
        return items, pos
    raise ValueError(f"GGUF value type {vtype}")


def parse(b: bytes) -> GGUF:
    assert b[:4] == b"GGUF"
    version, n_t, n_kv = struct.unpack_from("<IQQ", b, 4)
    pos, kvs, kv_at = 24, [], {}
    for _ in range(n_kv):
        key, pos = _str(b, pos)
        vtype = struct.unpack_from("<I", b, pos)[0]
        start = pos + 4
        value, pos = _value(b, start, vtype)
        kvs.append([key, vtype, b[start:pos], value])
        kv_at[key] = start
    tensors = []
    for _ in range(n_t):
        at = pos
        name, pos = _str(b, pos)
        nd = struct.unpack_from("<I", b, pos)[0]
        dims = list(struct.unpack_from(f"<{nd}Q", b, pos + 4))
        pos += 4 + 8 * nd
        ttype, off = struct.unpack_from("<IQ", b, pos)
        pos += 12
        tensors.append(Tensor(name, dims, ttype, off, at))
    align = next((v for k, _, _, v in kvs if k == "general.alignment"), 32)
    g = GGUF(version, kvs, tensors, pos + (-pos % align), b, pos, align, kv_at)
    return g


def _pstr(s: str) -> bytes:
    e = s.encode("utf-8")
    return struct.pack("<Q", len(e)) + e


def _pvalue(vtype, v) -> bytes:
    if vtype in SCALAR:
        return struct.pack("<" + SCALAR[vtype], v)
    if vtype == 8:
        return _pstr(v)
    raise ValueError(vtype)


def write(path: Path, g: GGUF):
    """The file of ``g``'s keys and tensor infos, padded to its alignment, then the original data section."""
    out = [b"GGUF", struct.pack("<IQQ", g.version, len(g.tensors), len(g.kvs))]
    for key, vtype, raw, _ in g.kvs:
        out += [_pstr(key), struct.pack("<I", vtype), raw]
    for t in g.tensors:
        out += [_pstr(t.name), struct.pack("<I", len(t.dims)), struct.pack(f"<{len(t.dims)}Q", *t.dims),
                struct.pack("<IQ", t.type, t.offset)]
    head = b"".join(out)
    head += b"\0" * (-len(head) % g.alignment)
    path.write_bytes(head + g.raw[g.data_start:])


def _file(d: Path) -> Path:
    return next(d.glob("*.gguf"))


def _load(d):
    f = _file(d)
    return f, parse(f.read_bytes())


def _flip(b: bytes, pos: int, bit: int) -> bytes:
    return b[:pos] + bytes([b[pos] ^ (1 << bit)]) + b[pos + 1:]


def g_truncate(d, rng):
    f, g = _load(d)
    where = rng.choice(["in the keys", "in the tensor infos", "in the data", "last byte"])
    first = g.tensors[0].at
    cut = {"in the keys": rng.randrange(4, first), "in the tensor infos": rng.randrange(first, g.infos_end),
           "in the data": rng.randrange(g.data_start, len(g.raw) - 1), "last byte": len(g.raw) - 1}[where]
    f.write_bytes(g.raw[:cut])
    return f"truncated {where} at {cut}/{len(g.raw)}"


def g_flip_data(d, rng):
    f, g = _load(d)
    t = rng.choice(g.tensors)
    pos, bit = rng.randrange(t.nbytes()), rng.randrange(8)
    f.write_bytes(_flip(g.raw, g.data_start + t.offset + pos, bit))
    return f"bit {bit} of byte {pos} of {t.name} ({TYPE_NAMES.get(t.type)})"


def g_flip_padding(d, rng):
    """A bit of the zero padding before the data section or between tensors (harmless: nothing reads it)."""
    f, g = _load(d)
    used = sorted((g.data_start + t.offset, g.data_start + t.offset + t.nbytes()) for t in g.tensors)
    gaps = [(g.infos_end, g.data_start)] + [(a[1], b[0]) for a, b in zip(used, used[1:])] + [(used[-1][1], len(g.raw))]
    gaps = [x for x in gaps if x[1] > x[0]]
    if not gaps:
        return g_flip_data(d, rng)
    lo, hi = rng.choice(gaps)
    pos = rng.randrange(lo, hi)
    f.write_bytes(_flip(g.raw, pos, rng.randrange(8)))
    return f"padding byte {pos} (gap {lo}..{hi})"


def g_flip_header(d, rng):
    f, g = _load(d)
    pos, bit = rng.randrange(4, g.infos_end), rng.randrange(8)
    f.write_bytes(_flip(g.raw, pos, bit))
    return f"header bit {bit} at {pos}"


def g_type(d, rng):
    f, g = _load(d)
    t = rng.choice(g.tensors)
    new = rng.choice([x for x in (0, 1, 2, 3, 8, 12, 14, 30, 39, 4, 99) if x != t.type])
    old, t.type = t.type, new
    write(f, g)
    return f"{t.name} type {TYPE_NAMES.get(old, old)}->{TYPE_NAMES.get(new, new)}"


def g_offset(d, rng):
    f, g = _load(d)
    t = rng.choice(g.tensors)
    size = len(g.raw) - g.data_start
    how = rng.choice(["+alignment", "-alignment", "+1", "past the end", "onto another", "at the end"])
    others = [o for o in g.tensors if o is not t]
    new = {"+alignment": t.offset + g.alignment, "-alignment": t.offset - g.alignment, "+1": t.offset + 1,
           "past the end": size + g.alignment * 4, "onto another": rng.choice(others).offset,
           "at the end": size - t.nbytes() + g.alignment}[how]
    if new < 0:
        new = t.offset + 2 * g.alignment
    old, t.offset = t.offset, new
    write(f, g)
    return f"{t.name} offset {how}: {old}->{new}"


def g_dims(d, rng):
    f, g = _load(d)
    t = rng.choice([t for t in g.tensors if len(t.dims) == 2])
    old = list(t.dims)
    t.dims = rng.choice([o for o in ([old[::-1], [old[0], old[1] * 2], [old[0], old[1] // 2], [old[0] * old[1]],
                                      [old[0] + 32, old[1]], [old[0], old[1], 1]]) if o != old])
    write(f, g)
    return f"{t.name} dims {old}->{t.dims}"


def _set_kv(g, key, value, vtype=None):
    for kv in g.kvs:
        if kv[0] == key:
            kv[1] = kv[1] if vtype is None else vtype
            kv[2], kv[3] = _pvalue(kv[1], value), value
            return
    g.kvs.append([key, vtype, _pvalue(vtype, value), value])


def g_kv_number(d, rng):
    f, g = _load(d)
    keys = [k for k, t, _, _ in g.kvs if t in SCALAR and t != 7]
    key = rng.choice(keys)
    old = g.kv(key)
    vtype = next(t for k, t, _, _ in g.kvs if k == key)
    if vtype in (6, 12):
        new = rng.choice([old * 2, 0.0, -old, old + 1.0])
    else:
        new = rng.choice([v for v in (old + 1, max(old - 1, 0), old * 2, 0, 1, 3) if v != old] or [old + 1])
    if rng.random() < 0.15:  # the same number as another type
        vtype, new = rng.choice([(6, float(new)), (8, str(new)), (11, int(new))])
    _set_kv(g, key, new, vtype)
    write(f, g)
    return f"kv {key}: {old!r}->{new!r}"


def g_kv_arch(d, rng):
    f, g = _load(d)
    old = g.kv("general.architecture")
    new = rng.choice(["qwen2", "gpt2", "llamax", "", "mistral"])
    _set_kv(g, "general.architecture", new)
    write(f, g)
    return f"kv general.architecture: {old!r}->{new!r}"


def g_kv_delete(d, rng):
    f, g = _load(d)
    arch = g.kv("general.architecture") or "llama"
    keys = [k for k, *_ in g.kvs]
    wanted = [k for k in keys if k.startswith(arch + ".")]
    key = rng.choice(wanted if wanted and rng.random() < 0.7 else keys)
    g.kvs = [kv for kv in g.kvs if kv[0] != key]
    write(f, g)
    return f"deleted kv {key}"


def g_kv_alignment(d, rng):
    f, g = _load(d)
    new = rng.choice([1, 7, 64, 0, 16])
    _set_kv(g, "general.alignment", new, 4)
    write(f, g)  # written with the old padding: the data section no longer starts where the new alignment says
    return f"kv general.alignment={new} (data not moved)"


def g_rename(d, rng):
    f, g = _load(d)
    t = rng.choice(g.tensors)
    old = t.name
    t.name = rng.choice([old + "x", old.replace("blk.0.", "blk.5.") if "blk." in old else "blk.9." + old,
                         rng.choice([o.name for o in g.tensors if o is not t]), old.replace("weight", "bias")])
    write(f, g)
    return f"renamed {old}->{t.name}"


def g_delete(d, rng):
    f, g = _load(d)
    t = rng.choice(g.tensors)
    g.tensors = [o for o in g.tensors if o is not t]
    write(f, g)
    return f"deleted tensor info {t.name}"


def g_swap(d, rng):
    """Two tensors of one type and shape exchange offsets: their data swapped, the file well-formed."""
    f, g = _load(d)
    groups = {}
    for t in g.tensors:
        groups.setdefault((t.type, tuple(t.dims)), []).append(t)
    data = {t.name: g.raw[g.data_start + t.offset:g.data_start + t.offset + t.nbytes()] for t in g.tensors}
    pairs = [(a, b) for v in groups.values() for i, a in enumerate(v) for b in v[i + 1:]
             if data[a.name] != data[b.name]]
    a, b = rng.choice(pairs)
    a.offset, b.offset = b.offset, a.offset
    write(f, g)
    return f"swapped {a.name}<->{b.name} (offsets)"


def g_sidecar(d, rng):
    side = d / "gguf_export.json"
    how = rng.choice(["removed", "emptied"])
    if how == "removed":
        side.unlink()
    else:
        side.write_text("{}")
    return f"gguf_export.json {how}"


GGUF_MUTATIONS = [g_truncate, g_flip_data, g_flip_padding, g_flip_header, g_type, g_offset, g_dims, g_kv_number,
                  g_kv_arch, g_kv_delete, g_kv_alignment, g_rename, g_delete, g_swap, g_sidecar]


def names_of(d: Path) -> set:
    """What a GGUF error may name: the file, its keys and tensor names."""
    f, g = _load(d)
    return {str(f), f.name, *(k for k, *_ in g.kvs), *(t.name for t in g.tensors)}

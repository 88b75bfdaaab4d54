"""Reading a GGUF file: its header (metadata, tensor table, every tensor checked to lie inside the
file) and its tensors, by mx.load where it reads them exactly and by the gguf package otherwise
(see the package's docstring)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from mlx_spec.errors import MlxSpecError
from mlx_spec.models.checkpoint import one_line

# GGUF packs Q4_0 / Q4_1 / Q8_0 in blocks of 32 values; mx.load keeps that as the group size.
GGUF_GROUP_SIZE = 32


# ggml tensor types by number, with (values per block, bytes per block)
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16, _F64 = 0, 1, 2, 3, 8, 30, 28
_FLOAT_TYPES = {_F32, _F16, _BF16, _F64}
# Types mx.load hands back exactly: floats and the packed affine triples. (mx.load also
# accepts Q2_K / Q4_K / Q6_K / BF16, converting them to float16, but its Q4_K values are
# wrong in MLX 0.32 and BF16 loses range: those go through the gguf package.)
_MX_TYPES = {_F32, _F16, _Q4_0, _Q4_1, _Q8_0}
_MX_PACKED_TYPES = {_Q4_0, _Q4_1, _Q8_0}


class _TensorInfo:
    __slots__ = ("name", "shape", "qtype", "offset", "nbytes")

    def __init__(self, name, shape, qtype, offset, nbytes):
        self.name, self.shape, self.qtype, self.offset, self.nbytes = (name, shape, qtype, offset, nbytes)

    @property
    def type_name(self) -> str:
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"type {self.qtype}"


def _check_file(path: Path) -> None:
    if not path.exists():
        raise MlxSpecError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise MlxSpecError(f"not a file: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise MlxSpecError(f"cannot read {path}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise MlxSpecError(f"not a GGUF file (bad magic number): {path}")


def _read_header(path: Path) -> Tuple[Dict[str, Any], List[_TensorInfo]]:
    """Metadata and tensor table of a GGUF file (v2/v3), read with the gguf package's reader
    (a memory map: only the header is read), every tensor checked to lie inside the file."""
    import gguf

    _check_file(path)
    try:
        size = path.stat().st_size
        reader = gguf.GGUFReader(str(path), "r")
        metadata = {
            key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")
        }
        tables = [
            (t.name, tuple(reversed([int(d) for d in t.shape])), int(t.tensor_type), int(t.data_offset))
            for t in reader.tensors
        ]
    except OSError as e:
        raise MlxSpecError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, UnicodeDecodeError) as e:
        # the reader's own words: a version other than 2 and 3, a table past the end, ...
        raise MlxSpecError(f"truncated or corrupt GGUF file ({one_line(e)}): {path}") from None
    infos = []
    for name, shape, qtype, offset in tables:
        if qtype not in gguf.GGML_QUANT_SIZES:
            raise MlxSpecError(f"unknown GGUF tensor type {qtype} for {name}: {path}")
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if shape and shape[-1] % block:
            raise MlxSpecError(f"corrupt GGUF file {path}: tensor {name} has a partial block")
        info = _TensorInfo(name, shape, qtype, offset, n // block * block_bytes)
        if info.offset + info.nbytes > size:
            raise MlxSpecError(f"truncated GGUF file (tensor {name} extends past the end): {path}")
        infos.append(info)
    return metadata, infos


class _Tensors:
    """A GGUF file's tensors grouped per base name ("blk.0.attn_q" -> weight, bias).

    Q4_0 / Q4_1 / Q8_0 tensors come from mx.load as MLX affine triples ("weight" uint32,
    "scales", "biases"; group size 32) when mx.load can read the whole file; every other
    type is read from the file and dequantized with the gguf package.
    """

    def __init__(self, path: Path, infos: List[_TensorInfo]):
        self.path = path
        self._infos: Dict[str, Dict[str, _TensorInfo]] = {}
        for info in infos:
            base, _, suffix = info.name.rpartition(".")
            if not base or suffix not in ("weight", "bias"):
                raise MlxSpecError(f"unexpected tensor name in GGUF file: {info.name}")
            self._infos.setdefault(base, {})[suffix] = info
        self._mx: Optional[Dict[str, mx.array]] = None
        types = {i.qtype for i in infos}
        if types & _MX_PACKED_TYPES and types <= _MX_TYPES:
            try:
                self._mx = mx.load(str(path))
            except Exception as e:  # noqa: BLE001  (RuntimeError / ValueError from mx.load)
                raise MlxSpecError(f"cannot read GGUF file {path}: {one_line(e)}") from None
        self._data = None

    @property
    def reader(self) -> str:
        return "mlx" if self._mx is not None else "gguf"

    def names(self) -> List[str]:
        return list(self._infos)

    def params(self, base: str) -> set:
        """Which parameters ("weight", "bias") a tensor has; empty when absent."""
        return set(self._infos.get(base, ()))

    def quantized(self, base: str) -> bool:
        """Whether the file stores this tensor in a quantized type."""
        return any(i.qtype not in _FLOAT_TYPES for i in self._infos[base].values())

    def packed(self, base: str) -> bool:
        """Whether get() returns it as an MLX affine triple."""
        return self._mx is not None and self._infos[base]["weight"].qtype in _MX_PACKED_TYPES

    def shape(self, base: str) -> Tuple[int, ...]:
        """Logical shape of the ".weight" tensor, rows first."""
        return self._infos[base]["weight"].shape

    def get(self, base: str) -> Dict[str, mx.array]:
        out = {}
        for suffix, info in self._infos[base].items():
            if self._mx is not None:
                for part in (suffix, "scales", "biases") if suffix == "weight" else (suffix,):
                    key = f"{base}.{part}"
                    if key in self._mx:
                        out[part] = self._mx[key]
            else:
                out[suffix] = self._read(info)
        return out

    def _read(self, info: _TensorInfo) -> mx.array:
        import gguf

        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._data[info.offset : info.offset + info.nbytes]
        shape = info.shape or (1,)
        if info.qtype == _F32:
            return mx.array(raw.view(np.float32).reshape(shape))
        if info.qtype == _F16:
            return mx.array(raw.view(np.float16).reshape(shape))
        if info.qtype == _F64:
            return mx.array(raw.view(np.float64).astype(np.float32).reshape(shape))
        rows = raw.reshape(int(np.prod(shape[:-1], dtype=np.int64)), -1)
        try:
            values = gguf.quants.dequantize(np.asarray(rows), info.qtype)
        except NotImplementedError:
            raise MlxSpecError(f"unsupported GGUF tensor type {info.type_name} for {info.name}") from None
        arr = mx.array(np.asarray(values, dtype=np.float32).reshape(shape))
        return arr.astype(mx.bfloat16) if info.qtype == _BF16 else arr


def _open_gguf(path: Path) -> Tuple[Dict[str, Any], _Tensors]:
    metadata, infos = _read_header(path)
    return metadata, _Tensors(path, infos)


def read_gguf_metadata(gguf_path) -> Dict[str, Any]:
    """All metadata of a GGUF file as plain Python values (reads the header only;
    MlxSpecError on a bad file)."""
    metadata, _ = _read_header(Path(gguf_path).expanduser())
    return metadata


def md_int(md: Dict[str, Any], key: str, default: Optional[int] = None) -> Optional[int]:
    v = md.get(key, default)
    if v is None:
        return None
    if isinstance(v, list):  # per-layer arrays: plain llama never varies them
        if not v or len(set(v)) != 1:
            raise MlxSpecError(f"unsupported GGUF metadata: {key} varies per layer")
        v = v[0]
    return int(v)

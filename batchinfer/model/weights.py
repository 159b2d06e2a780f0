"""Checkpoint tensors read only as far as a rank needs them.

The weight loaders see each checkpoint tensor as a CheckpointTensor: its shape and dtype
come from the safetensors header, narrow() picks rows or columns without reading, and
read() reads what was picked. So under tensor parallelism a rank reads its shard of each
tensor, never the whole. Each read opens the file again: pages of a file mapping count
in the process's memory while its handle is open, so one handle held over a whole file
would grow a rank's peak memory by every page it touched there. A tensor already in
memory (pickle checkpoints) is wrapped the same way.
"""
from __future__ import annotations

from pathlib import Path

import torch

# the safetensors header's dtype names
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}

# bytes read() has returned from safetensors files in this process
bytes_read = 0


class CheckpointTensor:
    """One checkpoint tensor, or a narrowed part of it, not read yet."""

    def __init__(self, source: torch.Tensor | tuple[Path, str], shape, dtype: torch.dtype,
                 index: tuple[slice, ...] = ()):
        self._source = source      # the tensor, or (file, tensor name)
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._index = index        # what to read of the source: a slice per leading dim

    @classmethod
    def in_memory(cls, tensor: torch.Tensor) -> CheckpointTensor:
        return cls(tensor, tensor.shape, tensor.dtype)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        """Rows (dim 0) or columns (dim 1) start to start + length, as torch's narrow."""
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(f"has shape {list(self.shape)}, which has no {start}:"
                             f"{start + length} along dimension {dim}")
        index = list(self._index) + [slice(None)] * (dim + 1 - len(self._index))
        first = index[dim].start or 0
        index[dim] = slice(first + start, first + start + length)
        shape = list(self.shape)
        shape[dim] = length
        return CheckpointTensor(self._source, shape, self.dtype, tuple(index))

    def read(self) -> torch.Tensor:
        """What this stands for, in the checkpoint's dtype, on the CPU. A part of a file's
        tensor may be a view of the file's pages (copy it where it is to stay)."""
        global bytes_read
        if isinstance(self._source, torch.Tensor):
            return self._source[self._index] if self._index else self._source
        from safetensors import SafetensorError, safe_open
        path, name = self._source
        try:
            with safe_open(str(path), framework="pt") as f:
                tensor = f.get_slice(name)[self._index] if self._index else f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"is in {path}, which cannot be read ({e}); it is damaged or "
                             "incomplete: copy or download it again") from None
        bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def file_tensors(path: Path) -> list[tuple[str, CheckpointTensor]]:
    """The tensors of a safetensors file, by name, from its header (none is read)."""
    from safetensors import safe_open
    out = []
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            header = f.get_slice(name)
            dtype = header.get_dtype()
            if dtype not in _DTYPES:
                raise ValueError(f"tensor {name!r} in {path} has dtype {dtype}, which is "
                                 "not supported")
            out.append((name, CheckpointTensor((path, name), header.get_shape(),
                                               _DTYPES[dtype])))
    return out

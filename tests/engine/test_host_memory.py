"""Host memory on CPU: KV cache pages backed ahead of the blocks' first use."""
from __future__ import annotations

import ctypes
import mmap
import sys

import pytest

from batchinfer import LLM, SamplingParams
from batchinfer.engine import host_memory
from batchinfer.engine.host_memory import KVPagePopulator

def resident_pages(address: int, length: int) -> list[bool]:
    """Which pages of a page-aligned range are backed by memory now (mincore)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) == 0
    return [bool(v & 1) for v in vec]


def anonymous_map(pages: int):
    region = mmap.mmap(-1, pages * mmap.PAGESIZE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    return region, address


@pytest.fixture(scope="module")
def populate_works():
    """Skips where pages cannot be populated ahead (and mincore read): Linux 5.14 on."""
    region, address = anonymous_map(1)
    if not (sys.platform.startswith("linux") and host_memory.populate(address, 1)):
        pytest.skip("no MADV_POPULATE_WRITE here (Linux 5.14 and later)")
    del region


def test_populate_backs_the_pages_and_keeps_their_contents(populate_works):
    region, address = anonymous_map(8)
    region[5] = 7
    assert host_memory.populate(address, 1)
    assert resident_pages(address, 8 * mmap.PAGESIZE)[:2] == [True, False]
    # an unaligned range is widened to whole pages
    assert host_memory.populate(address + 2 * mmap.PAGESIZE + 100, 2 * mmap.PAGESIZE)
    assert resident_pages(address, 8 * mmap.PAGESIZE) == [True, False, True, True, True,
                                                          False, False, False]
    assert region[5] == 7


def test_populator_backs_blocks_ahead_of_use_per_region(populate_works, monkeypatch):
    """Two regions (a layer's K and V) of 16 blocks of one page each; blocks up to the
    highest id in use plus the ahead budget are backed, in both, and only once."""
    maps = [anonymous_map(16), anonymous_map(16)]  # (kept mapped to the end)
    k, v = (address for _, address in maps)
    pop = KVPagePopulator([k, v], mmap.PAGESIZE, 16)
    pop.ahead_blocks = 2
    pop.cover(3)
    assert pop.populated == 6
    for address in (k, v):
        assert resident_pages(address, 16 * mmap.PAGESIZE) == [True] * 6 + [False] * 10
    calls = []
    real = host_memory.populate
    monkeypatch.setattr(host_memory, "populate", lambda a, n: calls.append((a, n)) or real(a, n))
    pop.cover(5)   # within what is backed: nothing to do
    assert calls == []
    pop.cover(14)  # up to 14 + 2, capped at the last block
    assert calls == [(k + 6 * mmap.PAGESIZE, 10 * mmap.PAGESIZE),
                     (v + 6 * mmap.PAGESIZE, 10 * mmap.PAGESIZE)]
    assert pop.populated == 16
    assert all(resident_pages(k, 16 * mmap.PAGESIZE))


def test_populator_stops_trying_where_the_os_cannot(monkeypatch):
    monkeypatch.setattr(host_memory, "populate", lambda a, n: False)
    pop = KVPagePopulator([4096, 8192], 64, 100)
    pop.cover(0)
    assert pop.populated == 100  # no further calls
    monkeypatch.setattr(host_memory, "populate", lambda a, n: pytest.fail("called again"))
    pop.cover(99)


def test_an_engine_on_cpu_backs_the_blocks_its_steps_use(llama_dir, monkeypatch,
                                                         populate_works):
    """Every block a step writes lies within what was backed before the step ran (each
    layer's K and V are regions of the populator), and the backed part grows only as
    blocks come into use."""
    llm = LLM(model=str(llama_dir), max_model_len=256, num_kv_blocks=400)
    runner = llm.llm_engine.model_runner
    pages = runner.kv_pages
    assert pages is not None and pages.num_blocks == 400
    cache_k, cache_v = runner.kv_caches[0]
    assert pages.regions[:2] == [cache_k.data_ptr(), cache_v.data_ptr()]
    assert pages.block_bytes == cache_k[0].numel() * cache_k.element_size()
    pages.ahead_blocks = 1
    assert pages.populated == 0
    seen = []
    forward = runner.model.forward

    def check(ids, positions, meta, caches):
        written = int(meta.slot_mapping.max()) // runner.block_size
        seen.append((written, pages.populated))
        return forward(ids, positions, meta, caches)

    monkeypatch.setattr(runner.model, "forward", check)
    llm.generate([[1, 2, 3 + i] * 30 for i in range(6)],
                 SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert seen and all(written < populated for written, populated in seen)
    # six prompts of 90 tokens and 40 more: about 6 x 9 blocks of 16 in use, far below 400
    assert 40 <= pages.populated <= 80

"""Small memset nodes of a captured graph turned into fill-kernel nodes: the graph writes
exactly what its memsets wrote (every element size, pitched 2-D blocks, values of every
byte), larger memsets keep their nodes, and a chain of cuBLAS GEMMs and cuDNN attention
computes the same bits either way."""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")

from dataflow.engine.backends.graph_memsets import memsets_to_kernels  # noqa: E402

pytestmark = pytest.mark.gpu


def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _memsets(buffer: torch.Tensor, big: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Driver memsets on ``stream`` (captured as memset nodes): each element size, a
    pitched block, and one larger than ``memsets_to_kernels``' default limit."""
    lib, base, s = _driver(), buffer.data_ptr(), ctypes.c_void_p(stream.cuda_stream)
    u64, size = ctypes.c_uint64, ctypes.c_size_t
    calls = [
        lib.cuMemsetD32Async(u64(base), ctypes.c_uint(0xDEADBEEF), size(5), s),
        lib.cuMemsetD8Async(u64(base + 101), ctypes.c_ubyte(0x7F), size(3), s),
        lib.cuMemsetD16Async(u64(base + 202), ctypes.c_ushort(0xABCD), size(7), s),
        # 4 rows of 3 u32 each, rows 64 bytes apart
        lib.cuMemsetD2D32Async(
            u64(base + 1024), size(64), ctypes.c_uint(0x01020304), size(3), size(4), s
        ),
        lib.cuMemsetD32Async(
            u64(big.data_ptr()), ctypes.c_uint(0x3F800000), size(big.numel() // 4), s
        ),
    ]
    assert calls == [0] * len(calls), calls


def _expected(n: int) -> torch.Tensor:
    want = torch.full((n,), 0x55, dtype=torch.uint8)
    want[:20] = torch.tensor([0xEF, 0xBE, 0xAD, 0xDE] * 5, dtype=torch.uint8)
    want[101:104] = 0x7F
    want[202:216] = torch.tensor([0xCD, 0xAB] * 7, dtype=torch.uint8)
    for row in range(4):
        start = 1024 + 64 * row
        want[start : start + 12] = torch.tensor([4, 3, 2, 1] * 3, dtype=torch.uint8)
    return want


@pytest.mark.parametrize("rewrite", [False, True])
def test_fill_kernels_write_what_the_memsets_wrote(rewrite: bool) -> None:
    buffer = torch.full((4096,), 0x55, dtype=torch.uint8, device="cuda")
    big = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda")  # 4 MiB: stays a memset
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, stream=stream):
        _memsets(buffer, big, stream)
    replaced = memsets_to_kernels(graph.raw_cuda_graph()) if rewrite else 0
    graph.instantiate()
    assert replaced == (4 if rewrite else 0)
    for _ in range(2):  # a replay writes the same again over what the last one left
        buffer.fill_(0x55)
        big.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(buffer.cpu(), _expected(buffer.numel()))
        assert torch.equal(big.view(torch.float32), torch.ones(big.numel() // 4, device="cuda"))


def test_a_gemm_and_attention_chain_computes_the_same_bits_with_fill_kernels() -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    d, heads, bf = 256, 4, torch.bfloat16
    x = torch.randn(2, 512, d, device="cuda", dtype=bf)
    w = [
        (
            torch.randn(3 * d, d, device="cuda", dtype=bf) * 0.05,
            torch.randn(3 * d, device="cuda", dtype=bf),
        )
        for _ in range(3)
    ]

    def chain() -> torch.Tensor:
        h = x
        for weight, bias in w:
            q, k, v = (
                F.linear(h, weight, bias).view(2, 512, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            )
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + a.transpose(1, 2).reshape(2, 512, d)
        return h

    outputs, counts = [], []
    for rewrite in (False, True):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain()  # plans and workspaces made before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, stream=stream):
            out = chain()
        counts.append(memsets_to_kernels(graph.raw_cuda_graph()) if rewrite else 0)
        graph.instantiate()
        graph.replay()
        torch.cuda.synchronize()
        outputs.append(out.clone())
    assert torch.equal(outputs[0], outputs[1])
    if torch.cuda.get_device_capability() == (9, 0):
        # Hopper: cuBLASLt's nvjet GEMMs and cuDNN's attention zero a counter before they
        # run (benchmarks/results/memset_nodes.json)
        assert counts[1] > 0

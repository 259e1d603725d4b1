"""Small memsets in a captured CUDA graph, turned into kernel nodes.

cuBLASLt (its Hopper ``nvjet`` GEMMs) and cuDNN (its fused attention) zero a 4-byte
counter before many of their kernels with ``cudaMemsetAsync``; under stream capture each
becomes a memset node. Inside a whole training step, with both copy directions busy, a
memset node stalls the compute stream far longer than a kernel does: in the profiled step
of gpt2_124m at 1 GiB (``benchmarks/results/trace_vs_sim_gpt2_1GiB.json``) the 9,728
memsets took 24 ms and the gaps beside them 136 ms of a 1.60 s step.
``benchmarks/memset_nodes.py`` measures the same chain of GEMMs and attention with memset
nodes and with these kernel nodes, alone and beside busy copy engines.

``memsets_to_kernels`` rewrites a captured graph before it is instantiated: every memset
node of at most ``max_bytes`` becomes a node of a fill kernel with the same destination,
value, element size, width, height and pitch, wired to the same dependencies and
dependents. The kernel is a few lines of PTX, compiled by the driver for the device at
hand, so nothing is built ahead. It goes through the CUDA driver API (``libcuda``) with
ctypes: torch exposes the captured ``cudaGraph_t`` (``CUDAGraph(keep_graph=True)``,
``raw_cuda_graph``) but no way to edit it.
"""

from __future__ import annotations

import ctypes
from functools import cache

#: the driver's node type of a memset node (``CU_GRAPH_NODE_TYPE_MEMSET``)
_MEMSET = 2
#: threads per block of the fill kernel
_THREADS = 256

_FILL_ENTRY = """
.visible .entry df_fill{bits}(.param .u64 p_dst, .param .u32 p_value, .param .u64 p_width,
                             .param .u64 p_height, .param .u64 p_pitch)
{{
    .reg .pred %p;
    .reg .b32 %r<5>;
    .reg .b64 %rd<13>;
    ld.param.u64 %rd1, [p_dst];
    ld.param.u32 %r1, [p_value];
    ld.param.u64 %rd2, [p_width];
    ld.param.u64 %rd3, [p_height];
    ld.param.u64 %rd4, [p_pitch];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mul.wide.u32 %rd5, %r2, %r3;
    cvt.u64.u32 %rd6, %r4;
    add.u64 %rd5, %rd5, %rd6;
    mul.lo.u64 %rd7, %rd2, %rd3;
    setp.ge.u64 %p, %rd5, %rd7;
    @%p bra DONE;
    div.u64 %rd8, %rd5, %rd2;
    rem.u64 %rd9, %rd5, %rd2;
    mad.lo.u64 %rd10, %rd8, %rd4, %rd1;
    shl.b64 %rd11, %rd9, {shift};
    add.u64 %rd12, %rd10, %rd11;
    st.global.u{bits} [%rd12], %r1;
DONE:
    ret;
}}
"""
#: one entry per memset element size (1, 2 or 4 bytes): element ``i`` of the ``width`` x
#: ``height`` block is at ``dst + (i // width) * pitch + (i % width) * size``
FILL_PTX = ".version 7.0\n.target sm_70\n.address_size 64\n" + "".join(
    _FILL_ENTRY.format(bits=8 * size, shift=shift) for size, shift in ((1, 0), (2, 1), (4, 2))
)


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [
        ("dst", ctypes.c_uint64),
        ("pitch", ctypes.c_size_t),
        ("value", ctypes.c_uint),
        ("elementSize", ctypes.c_uint),
        ("width", ctypes.c_size_t),
        ("height", ctypes.c_size_t),
    ]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [
        ("func", ctypes.c_void_p),
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("kernelParams", ctypes.POINTER(ctypes.c_void_p)),
        ("extra", ctypes.POINTER(ctypes.c_void_p)),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


class _Driver:
    """The few driver calls the rewrite needs, each checked."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def __call__(self, name: str, *args) -> None:
        result = getattr(self.lib, name)(*args)
        if result != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(text))
            what = text.value.decode() if text.value else f"error {result}"
            raise RuntimeError(f"graph_memsets: {name} failed: {what}")

    def nodes(self, call: str, handle: int) -> list[int]:
        """The nodes ``call`` (``cuGraphGetNodes``, ``cuGraphNodeGetDependencies``,
        ``cuGraphNodeGetDependentNodes``) lists for ``handle``."""
        # the edge lists' first form; drivers of CUDA 13 may have only the one taking
        # edge data (None: plain edges, all that stream capture makes here)
        edges = () if call == "cuGraphGetNodes" or hasattr(self.lib, call) else (None,)
        call = call if not edges else f"{call}_v2"
        count = ctypes.c_size_t(0)
        self(call, ctypes.c_void_p(handle), None, *edges, ctypes.byref(count))
        if count.value == 0:
            return []
        found = (ctypes.c_void_p * count.value)()
        self(call, ctypes.c_void_p(handle), found, *edges, ctypes.byref(count))
        return [found[i] for i in range(count.value)]

    def add_edges(self, graph: int, sources: list[int], targets: list[int]) -> None:
        edges = () if hasattr(self.lib, "cuGraphAddDependencies") else (None,)
        call = "cuGraphAddDependencies" if not edges else "cuGraphAddDependencies_v2"
        count = len(sources)
        self(
            call,
            ctypes.c_void_p(graph),
            (ctypes.c_void_p * count)(*sources),
            (ctypes.c_void_p * count)(*targets),
            *edges,
            ctypes.c_size_t(count),
        )


@cache
def _driver() -> _Driver:
    return _Driver()


@cache
def _fill_functions(context: int) -> dict[int, int]:
    """The fill kernel for each element size, loaded into ``context`` (the current one:
    torch's, of the current device; a function belongs to the context it was loaded in)."""
    driver = _driver()
    module = ctypes.c_void_p()
    driver("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(FILL_PTX.encode()))
    functions = {}
    for size in (1, 2, 4):
        func = ctypes.c_void_p()
        name = f"df_fill{8 * size}".encode()
        driver("cuModuleGetFunction", ctypes.byref(func), module, ctypes.c_char_p(name))
        functions[size] = func.value
    return functions


def memsets_to_kernels(graph: int, max_bytes: int = 1 << 20) -> int:
    """Replace every memset node of ``graph`` (a ``cudaGraph_t``, not yet instantiated)
    that sets at most ``max_bytes`` by a fill-kernel node doing the same; return how many
    were replaced. Larger memsets keep their nodes: they run at memory bandwidth, where a
    node's start-up no longer matters."""
    driver = _driver()
    context = ctypes.c_void_p()
    driver("cuCtxGetCurrent", ctypes.byref(context))
    functions = _fill_functions(context.value or 0)
    replaced = 0
    for node in driver.nodes("cuGraphGetNodes", graph):
        kind = ctypes.c_int()
        driver("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
        if kind.value != _MEMSET:
            continue
        memset = _MemsetParams()
        driver("cuGraphMemsetNodeGetParams", ctypes.c_void_p(node), ctypes.byref(memset))
        elements = memset.width * memset.height
        if memset.elementSize not in functions or elements * memset.elementSize > max_bytes:
            continue
        before = driver.nodes("cuGraphNodeGetDependencies", node)
        after = driver.nodes("cuGraphNodeGetDependentNodes", node)
        values = (
            ctypes.c_uint64(memset.dst),
            ctypes.c_uint(memset.value),
            ctypes.c_uint64(memset.width),
            ctypes.c_uint64(memset.height),
            ctypes.c_uint64(memset.pitch),
        )
        args = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        params = _KernelParams(
            func=functions[memset.elementSize],
            gridDimX=max(1, -(-elements // _THREADS)),
            gridDimY=1,
            gridDimZ=1,
            blockDimX=_THREADS,
            blockDimY=1,
            blockDimZ=1,
            sharedMemBytes=0,
            kernelParams=args,
        )
        fill = ctypes.c_void_p()
        deps = (ctypes.c_void_p * max(1, len(before)))(*before)
        driver(
            "cuGraphAddKernelNode_v2",
            ctypes.byref(fill),
            ctypes.c_void_p(graph),
            deps,
            ctypes.c_size_t(len(before)),
            ctypes.byref(params),
        )
        if after:
            driver.add_edges(graph, [fill.value] * len(after), after)
        driver("cuGraphDestroyNode", ctypes.c_void_p(node))
        replaced += 1
    return replaced

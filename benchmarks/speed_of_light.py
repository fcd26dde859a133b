"""How far PET's MD step is from its floor: each stage's least possible time against its measured time.

    python benchmarks/speed_of_light.py [--models s,m] [--atoms 192,17280] [--precisions fp16x3,tf32x3]
                                        [--dry-run] [--reps 10] [--out FILE.json]

For each model shape (random weights, ``ase_tcfp32.testing.random_pet``) and water box
(``ase_tcfp32.validation.water_box``: ``--atoms`` is rounded down to whole molecules),
builds the default calculator (``TCPETCalculator(pet, precision=...)``; on a CPU its
engine and skin are set to what a GPU would use, ``neighbor_skin`` 2 Å up to
``GRAPH_ATOMS`` atoms and 0.5 Å above), reads the pairs PET keeps (the engine's
``neighbor_counts``) and, from the model's own Linear layers and those counts, computes
each stage of one energy + forces + stress step, forward and backward:

- its tensor-core work: every Linear's ``2 M K N`` FLOPs times the products of the
  precision (fp16x3: 3 FP16 products; tf32x3: 3 TF32; bf16x9: 9 BF16); backward, with the
  weights frozen, one input-gradient product per forward product whose input depends on
  the positions; the attention's QK^T and PV over each atom's real sequence (its kept
  neighbors and itself) as our kernels compute them (TF32x3: 3 products, PV 4; backward 4
  products of 3);
- the bytes it must move through HBM at least: its input tensors read once and its output
  tensors written once (weights included; intermediates stay on chip); backward its
  inputs read again, the gradients of its outputs read and those of its inputs written;
- its floor, ``max(tensor-core FLOPs / peak + FP32 FLOPs / FP32 peak, bytes / HBM
  bandwidth)`` with :data:`PEAKS` (an H200 SXM's datasheet figures);

plus a launch floor: kernels per step (counted by the profiler) times the cost of one
kernel in a replayed CUDA graph (measured here: a graph of 1,000 one-element additions).

On CUDA (not with ``--dry-run``) it then measures: the step (median of ``--reps``
calls), each stage alone (its forward, and its backward from saved inputs, CUDA events,
median), and the kernels of the step by name with ``torch.profiler`` (GEMMs, attention,
SwiGLU, combination, norms, elementwise, copies...). The profiler sees the kernels of a
replayed CUDA graph when CUPTI reports them; where it sees none, the step is profiled with
plain launches (``engine="lean"``, same skin) and the row says so. The stages are called
through the package's own functions (``ase_tcfp32._packed``, ``_folded.compress``,
``_fused.combine_messages``, ``_heads.readout``) in its order, and their energies are
checked against ``ase_tcfp32._packed.predictions``. Each stage's measured time is its
own launches included: at small sizes it is bound by the host, which the default step
avoids by replaying a CUDA graph.

Prints a table per configuration (stage, GFLOP, GB, floor, measured, measured / floor),
the total floor against the measured step and the stages furthest above their floors;
writes the rows into ``benchmarks/results/speed_of_light_<gpu>.json`` (``--out``:
elsewhere). ``--dry-run`` (or a machine without CUDA) computes the floors only (the
neighbor counts are the same on a CPU).

What no floor here counts: the neighbor-list rebuilds (every few dozen steps), the host's
work, the adaptive-cutoff solver's iterations and the non-GEMM arithmetic (norms, SiLU,
softmax: far below the FP32 peak at these sizes), the recomputation of the attention's
probabilities in its backward pass, and the reverse-pair gather's traffic beyond one more
read of the messages.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from dataclasses import dataclass

import _results
import numpy as np
import torch
from _timing import timed

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32._engines import GRAPH_ATOMS, LARGE_SKIN, SMALL_SKIN
from ase_tcfp32._packed import _inner
from ase_tcfp32.layers import MIN_EMULATED_K
from ase_tcfp32.testing import random_pet
from ase_tcfp32.validation import water_box

PEAKS = {"fp16": 989e12, "bf16": 989e12, "tf32": 494e12, "fp32": 67e12, "hbm": 4.8e12}
"""An H200 SXM's peaks: dense tensor-core FLOP/s per word type (half the datasheet's
with-sparsity figures), FP32 FLOP/s on CUDA cores, HBM3e bytes/s. :data:`PEAKS_SOURCE`."""

PEAKS_SOURCE = (
    "NVIDIA H200 SXM datasheet (nvidia.com/en-us/data-center/h200): FP16/BF16 tensor core 1,979 and TF32 989 "
    "TFLOP/s with sparsity (dense: half), FP32 67 TFLOP/s, HBM3e 4.8 TB/s"
)

PRODUCTS = {"fp16x3": ("fp16", 3), "tf32x3": ("tf32", 3), "bf16x9": ("bf16", 9)}
"""Tensor-core products per Linear product, and their word type, of each FP32-accurate precision."""

ATTENTION_PRODUCTS = {"qk": 3, "pv": 4, "backward": 3}
"""TF32 tensor-core products of the attention kernels (``ase_tcfp32._kernels.attention``):
QK^T in TF32x3, PV with V in three TF32 words (4 products), each backward product TF32x3."""

FLOAT = 4
"""Bytes of an FP32 number; indices count as 4 bytes too (int32 would do)."""

KINDS = {
    "inputs": "pair geometry, cutoffs (backward: forces, virial)",
    "embeddings": "node and edge embeddings",
    "compression": "edge-token compression (folded)",
    "qkv": "norms, center contraction, QKV projection",
    "attention": "attention (QK^T, softmax, PV)",
    "projection": "attention output projection, residual",
    "feed_forward": "edge feed-forward (norm, SwiGLU)",
    "nodes": "node update (expansion, norm, SwiGLU)",
    "combination": "message combination (norm, MLP)",
    "readout": "energy head readout",
}
"""The kinds of stage, in the step's order, and what they compute."""


@dataclass
class Stage:
    """One stage of the step in one direction, and its floor."""

    name: str  # e.g. "GNN 2 · attention 1 · QKV projection"
    kind: str  # a key of KINDS
    direction: str  # "forward" or "backward"
    gemm_flops: float = 0.0  # 2 M K N of its tensor-core Linear products, one product each
    fp32_flops: float = 0.0  # products left in FP32 (K < MIN_EMULATED_K), on CUDA cores
    attention_flops: float = 0.0  # QK^T and PV (and their gradients), one product each
    attention_tf32_flops: float = 0.0  # the same as the kernels run them: TF32 products
    bytes: float = 0.0  # through HBM at least
    measured_ms: float | None = None

    def tensor_core_flops(self, precision: str) -> float:
        """FLOPs the tensor cores execute, every emulation product counted."""
        return self.gemm_flops * PRODUCTS[precision][1] + self.attention_tf32_flops

    def floor_ms(self, precision: str) -> tuple[float, str]:
        """The stage's least time on :data:`PEAKS` and what bounds it ("compute" or "memory")."""
        word, products = PRODUCTS[precision]
        compute = (
            self.gemm_flops * products / PEAKS[word]
            + self.attention_tf32_flops / PEAKS["tf32"]
            + self.fp32_flops / PEAKS["fp32"]
        )
        memory = self.bytes / PEAKS["hbm"]
        return 1e3 * max(compute, memory), "compute" if compute > memory else "memory"


def _stage_pair(name, kind, linears, inputs, outputs, attention=None, backward=True) -> list[Stage]:
    """The forward and backward :class:`Stage` of a stage that runs ``linears`` [(module,
    rows, input needs a gradient)], reads ``inputs`` [(bytes, gradient bytes written
    backward)] and writes ``outputs`` [(bytes, its gradient read backward)]; ``attention``:
    (sum over its sequences of T², model width) of its attention."""
    forward, back = Stage(name, kind, "forward"), Stage(name, kind, "backward")
    for module, rows, grad in linears:
        k, n = module.in_features, module.out_features
        flops = 2.0 * rows * k * n
        weight = FLOAT * (k * n + n)
        directions = [(forward, True), (back, grad)]
        for stage, runs in directions:
            if not runs:
                continue
            if k < MIN_EMULATED_K:
                stage.fp32_flops += flops
            else:
                stage.gemm_flops += flops
            stage.bytes += weight
    forward.bytes += sum(b for b, _ in inputs) + sum(b for b, _ in outputs)
    back.bytes += sum(b for b, _ in inputs) + sum(g for _, g in inputs) + sum(g for _, g in outputs)
    if attention is not None:
        sum_t2, width = attention
        one = 2.0 * width * sum_t2  # one product over every (query, key) pair of every head
        forward.attention_flops = 2 * one
        forward.attention_tf32_flops = one * (ATTENTION_PRODUCTS["qk"] + ATTENTION_PRODUCTS["pv"])
        back.attention_flops = 4 * one  # dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q
        back.attention_tf32_flops = 4 * one * ATTENTION_PRODUCTS["backward"]
    return [forward, back] if backward else [forward]


class _Folded:
    """A product of the folded compression as a Linear shape (``ase_tcfp32._folded``): the
    messages (d -> d) or the geometry ([v, |v|], 4 -> d, FP32)."""

    def __init__(self, in_features: int, out_features: int):
        self.in_features, self.out_features = in_features, out_features


def check_supported(pet: torch.nn.Module) -> None:
    """A clear error for a PET this model does not describe (PreLN layers with expanded
    node features, a feed-forward featurizer: every PET-MAD and uPET model)."""
    backend = pet.backend
    if backend.featurizer_type != "feedforward":
        raise ValueError(f"the stage model describes feed-forward featurizers, not {backend.featurizer_type!r}")
    for gnn in backend.gnn_layers:
        for layer in _inner(gnn).trans.layers:
            if layer.transformer_type != "PreLN" or not layer.expanded_node_features:
                raise ValueError("the stage model describes PreLN layers with expanded node features (PET-MAD's)")


def model_stages(pet: torch.nn.Module, counts: torch.Tensor, candidates: int, rows: int | None = None) -> list[Stage]:
    """The stages of one energy + forces + stress step of the metatrain ``pet`` on packed
    rows (``ase_tcfp32._packed``, the default engine's layout), forward then backward, for
    atoms whose kept neighbors are ``counts`` [N] and ``candidates`` candidate pairs (the
    Verlet list's, cutoff + skin), the edge work over ``rows`` rows (default: the kept
    pairs; the engine's buffer holds a few percent more). Only the energy head is read (a
    conservative step)."""
    check_supported(pet)
    backend = pet.backend
    n, e = int(counts.numel()), int(counts.sum()) if rows is None else rows
    sum_t2 = float(((counts.double() + 1) ** 2).sum())
    first = _inner(backend.gnn_layers[0]).trans.layers[0]
    d, dn = first.attention.input_linear.in_features, first.center_contraction.in_features
    stages = []
    # positions and candidate pairs (2 indices, a cell offset) in; per kept row: vector,
    # distance, cutoff factor, neighbor species, center, reverse row out
    inputs = _stage_pair("pair geometry and cutoffs", "inputs", [], [(n * 3 * FLOAT + candidates * 5 * FLOAT, 0)], [])
    inputs[0].bytes += e * 8 * FLOAT + n * 2 * FLOAT
    # backward: the rows' geometry gradients (vector, distance, factor), their atoms and
    # vectors (the virial) read; forces and the virial written
    inputs[1].bytes = e * (5 + 2 + 3) * FLOAT + n * 3 * FLOAT + 9 * FLOAT
    embeddings = _stage_pair("embeddings", "embeddings", [], [((n + e) * FLOAT, 0)], [], backward=False)
    embeddings[0].bytes += (n * dn + e * d) * FLOAT
    stages += inputs[:1] + embeddings
    backward = [inputs[1]]
    edge, node = e * d * FLOAT, n * d * FLOAT
    for number, (gnn, mlp) in enumerate(zip(backend.gnn_layers, backend.combination_mlps, strict=True)):
        gnn, prefix, later = _inner(gnn), f"GNN {number + 1}", number > 0
        pair = _stage_pair(
            f"{prefix} · compression",
            "compression",
            [
                (_Folded(d, d), e, later),
                (_Folded(4, d), e, True),
                (gnn.compress[2], e, True),
            ],
            [(edge, edge if later else 0), (e * 5 * FLOAT, e * 4 * FLOAT)],
            [(edge, edge)],
        )
        layer_stages = [pair]
        for t, layer in enumerate(gnn.trans.layers):
            node_grad = later or t > 0  # the first layer's node input is an embedding: no gradient
            block, name = layer.attention, f"{prefix} · attention {t + 1}"
            nodes_in = n * dn * FLOAT
            layer_stages.append(
                _stage_pair(
                    f"{name} · QKV projection",
                    "qkv",
                    [(layer.center_contraction, n, node_grad), (block.input_linear, e, True)]
                    + [(block.input_linear, n, node_grad)],
                    [(edge, edge), (nodes_in, nodes_in if node_grad else 0)],
                    [(3 * edge, 3 * edge), (3 * node, 3 * node if node_grad else 0)],
                )
            )
            layer_stages.append(
                _stage_pair(
                    f"{name} · attention",
                    "attention",
                    [],
                    [(3 * edge, 3 * edge), (3 * node, 3 * node if node_grad else 0), (e * FLOAT, e * FLOAT)],
                    [(edge, edge), (node, node)],
                    attention=(sum_t2, d),
                )
            )
            layer_stages.append(
                _stage_pair(
                    f"{name} · output projection",
                    "projection",
                    [(block.output_linear, e, True), (block.output_linear, n, True)],
                    [(edge, edge), (node, node), (edge, 0)],  # the residual's gradient is the output's
                    [(edge, edge), (node, node)],
                )
            )
            layer_stages.append(
                _stage_pair(
                    f"{name} · edge feed-forward",
                    "feed_forward",
                    [(layer.mlp.w_in, e, True), (layer.mlp.w_out, e, True)],
                    [(edge, edge)],
                    [(edge, edge)],
                )
            )
            layer_stages.append(
                _stage_pair(
                    f"{name} · node update",
                    "nodes",
                    [(layer.center_expansion, n, True), (layer.center_mlp.w_in, n, True)]
                    + [(layer.center_mlp.w_out, n, True)],
                    [(nodes_in, nodes_in if node_grad else 0), (node, node)],
                    [(nodes_in, nodes_in)],
                )
            )
        # the messages read twice (each row and its reverse pair's), the reverse rows' index,
        # the layer's input messages (a residual)
        layer_stages.append(
            _stage_pair(
                f"{prefix} · message combination",
                "combination",
                [(mlp[0], e, True), (mlp[2], e, True)],
                [(2 * edge, edge), (e * FLOAT, 0), (edge, 0)],
                [(edge, edge)],
            )
        )
        for pair in layer_stages:
            stages.append(pair[0])
            backward.append(pair[1])
    node_head, edge_head = backend.node_heads["energy"][0], backend.edge_heads["energy"][0]
    node_last, edge_last = (
        next(iter(h["energy"][0].values())) for h in (backend.node_last_layers, backend.edge_last_layers)
    )
    nodes_in = n * dn * FLOAT
    readout = _stage_pair(
        "energy readout",
        "readout",
        [(node_head[0], n, True), (node_head[2], n, True), (node_last, n, True)]
        + [(edge_head[0], e, True), (edge_head[2], e, True), (edge_last, e, True)],
        [(nodes_in, nodes_in), (edge, edge), (e * FLOAT, e * FLOAT), (e * FLOAT, 0)],
        [(n * FLOAT, n * FLOAT)],
    )
    stages.append(readout[0])
    backward.append(readout[1])
    return stages + backward[::-1]


def attention_flops(width: int, sum_t2: float) -> float:
    """One-product FLOPs of a forward attention (QK^T and PV) of model ``width`` (heads x
    head width) over sequences whose squared lengths sum to ``sum_t2``."""
    return 4.0 * width * sum_t2


def totals(stages: list[Stage], precision: str) -> dict:
    """The step's floors (ms): tensor-core work, memory traffic, and the sum of the stages'
    floors (each stage bound by the larger of its two)."""
    word, products = PRODUCTS[precision]
    compute = sum(
        s.gemm_flops * products / PEAKS[word] + s.attention_tf32_flops / PEAKS["tf32"] + s.fp32_flops / PEAKS["fp32"]
        for s in stages
    )
    return {
        "tensor_core_floor_ms": 1e3 * compute,
        "memory_floor_ms": 1e3 * sum(s.bytes for s in stages) / PEAKS["hbm"],
        "stage_floor_ms": sum(s.floor_ms(precision)[0] for s in stages),
        "tensor_core_gflop": sum(s.tensor_core_flops(precision) for s in stages) / 1e9,
        "gb": sum(s.bytes for s in stages) / 1e9,
    }


# ----- the calculator, its neighbors, and the stages run one by one ----------------------


def make_calculator(shape: str, precision: str, atoms, device: str, engine: str = "auto") -> TCPETCalculator:
    """The default calculator for a random ``shape`` model (``precision`` on CUDA; on a CPU
    fp32, the only one there), with the skin the default engine uses on a GPU for ``atoms``."""
    skin = SMALL_SKIN if len(atoms) <= GRAPH_ATOMS else LARGE_SKIN
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TCPETCalculator(
            random_pet(shape),
            precision=precision if device == "cuda" else "fp32",
            device=device,
            engine=engine,
            neighbor_skin=skin,
        )


def neighbors(calc: TCPETCalculator, atoms) -> tuple[torch.Tensor, int]:
    """The kept neighbors [N] of each atom (the engine's ``neighbor_counts``) and the
    candidate pairs of its Verlet list."""
    engine = calc._engine
    counts = engine.neighbor_counts([atoms]).cpu()
    return counts, int(engine.pairs.count)


class StagedStep:
    """The default engine's step on packed rows, cut into the stages of :func:`model_stages`
    and run one by one (``ase_tcfp32._packed``'s order, the package's functions)."""

    def __init__(self, calc: TCPETCalculator, atoms):
        from ase_tcfp32._inputs import packed_rows
        from ase_tcfp32._neighbors import Structures, pair_vectors

        self.engine = engine = calc._engine
        self.backend, self.device = calc.pet.backend, engine.device
        batch = Structures.of([atoms])
        engine._use(batch)
        counts = engine.neighbor_counts([atoms])
        if engine.rows == 0:  # an engine on the neighbor table (a CPU): packed rows for its pairs
            engine._set_rows(int(counts.sum()))
            engine._set_width(int(counts.max()) + 2)
        self.positions = torch.from_numpy(batch.positions).to(self.device, engine.dtype)
        numbers = torch.from_numpy(batch.numbers).to(self.device, torch.long)
        self.species = self.backend.species_to_species_index[numbers]
        self.n = len(atoms)
        self._pair_vectors, self._packed_rows = pair_vectors, packed_rows
        with torch.no_grad():
            self.packed = self.inputs(self.positions)[0]

    def inputs(self, positions: torch.Tensor) -> tuple:
        """Packed rows (``ase_tcfp32._inputs.packed_rows``) of the current pairs at ``positions``."""
        engine = self.engine
        vectors = self._pair_vectors(positions, engine.pairs)
        kept = engine._kept_pairs(vectors, self.n)
        packed = self._packed_rows(kept, engine.pairs, self.species, engine.columns, engine.rows)[0]
        return packed, vectors

    def stages(self) -> list[tuple]:
        """``(name, function, inputs, outputs)`` per forward stage, the function taking and
        returning dicts of tensors by name; names as :func:`model_stages`'."""
        from ase_tcfp32._attention import tc_attention_packed
        from ase_tcfp32._folded import compress
        from ase_tcfp32._fused import combine_messages
        from ase_tcfp32._heads import readout

        backend, packed = self.backend, self.packed
        out = [
            (
                "embeddings",
                lambda v: {
                    "nodes": backend.node_embedders[0](packed.species),
                    "messages": backend.edge_embedder(packed.neighbor_species),
                },
                [],
                ["nodes", "messages"],
            )
        ]
        layers = zip(backend.gnn_layers, backend.combination_norms, backend.combination_mlps)
        for number, (gnn, norm, mlp) in enumerate(layers):
            gnn, prefix = _inner(gnn), f"GNN {number + 1}"
            out.append(
                (
                    f"{prefix} · compression",
                    lambda v, gnn=gnn: {
                        "edges": compress(gnn, v["messages"], v["vectors"], v["distances"], packed.neighbor_species)
                    },
                    ["messages", "vectors", "distances"],
                    ["edges"],
                )
            )
            for t, layer in enumerate(gnn.trans.layers):
                name, block = f"{prefix} · attention {t + 1}", layer.attention

                def qkv(v, layer=layer, block=block):
                    center = layer.center_contraction(v["nodes"])
                    return {
                        "qkv": block.input_linear(layer.norm_attention(v["edges"])),
                        "node_qkv": block.input_linear(layer.norm_attention(center)),
                    }

                def attend(v, block=block):
                    scale = 1.0 / (block.head_dim**0.5 * block.temperature)
                    bias = torch.log(torch.clamp(v["factors"], block.epsilon))
                    att, node_att = tc_attention_packed(
                        v["qkv"], v["node_qkv"], bias, packed.sequences, block.num_heads, scale
                    )
                    return {"att": att, "node_att": node_att}

                def project(v, block=block):
                    return {
                        "edges": v["edges"] + block.output_linear(v["att"]),
                        "center": block.output_linear(v["node_att"]),
                    }

                def feed_forward(v, layer=layer):
                    return {"edges": v["edges"] + layer.mlp(layer.norm_mlp(v["edges"]))}

                def update(v, layer=layer):
                    nodes = v["nodes"] + layer.center_expansion(v["center"])
                    return {"nodes": nodes + layer.center_mlp(layer.norm_center_features(nodes))}

                out += [
                    (f"{name} · QKV projection", qkv, ["edges", "nodes"], ["qkv", "node_qkv"]),
                    (f"{name} · attention", attend, ["qkv", "node_qkv", "factors"], ["att", "node_att"]),
                    (f"{name} · output projection", project, ["att", "node_att", "edges"], ["edges", "center"]),
                    (f"{name} · edge feed-forward", feed_forward, ["edges"], ["edges"]),
                    (f"{name} · node update", update, ["nodes", "center"], ["nodes"]),
                ]

            def combine(v, norm=norm, mlp=mlp, post=(backend.gnn_layers_post_mp_edge[number],)):
                combined, summed = combine_messages(v["edges"], packed.reverse, norm, residual=v["messages"])
                return {"messages": post[0](summed + mlp(combined))}

            out.append((f"{prefix} · message combination", combine, ["edges", "messages"], ["messages"]))
        out.append(
            (
                "energy readout",
                lambda v: {
                    "energies": readout(
                        backend, "energy", v["nodes"], v["messages"], v["factors"], packed.real, packed.centers
                    )[0]
                },
                ["nodes", "messages", "factors"],
                ["energies"],
            )
        )
        return out

    def passes(self):
        """One pass of the stages in order (no gradients), yielding before each stage its
        ``(name, function, inputs, outputs)`` and the values of its inputs by name; the
        energies [N, 1] are ``self.energies`` after the last stage."""
        values = {"vectors": self.packed.vectors, "distances": self.packed.distances, "factors": self.packed.factors}
        for stage in self.stages():
            yield stage, {key: values[key] for key in stage[2]}
            with torch.no_grad():
                values.update(stage[1](values))
        self.energies = values["energies"]


def _timer(device: torch.device):
    """A function timing ``fn()`` ``reps`` times after ``warmup`` calls: median ms (CUDA
    events on a GPU, the wall clock on a CPU)."""

    def timed(fn, reps: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - begin))
        return statistics.median(times)

    return timed


def measure_stages(staged: StagedStep, reps: int) -> dict[tuple[str, str], float]:
    """Median ms of each stage's forward and backward, by (name, direction), each run alone
    on the values of one pass: forward with the autograd graph recorded (as in the step),
    backward from it with random output gradients."""
    timed = _timer(staged.device)
    measured = {}
    embedded = {"nodes", "messages"}  # embeddings, without a gradient until their first update
    for (name, function, ins, outs), found in staged.passes():
        grads = {key: key not in embedded for key in ins}
        leaves = {key: found[key].detach().requires_grad_(grads[key]) for key in ins}
        with torch.enable_grad():
            measured[(name, "forward")] = timed(lambda: function(leaves), reps)
            if name == "embeddings":
                continue
            measured[(name, "backward")] = _backward_ms(function, leaves, outs, timed, reps)
        embedded -= set(outs)
    measured.update(measure_inputs(staged, reps))
    return measured


def _backward_ms(function, leaves: dict, outs: list[str], timed, reps: int) -> float:
    """Median ms of the backward pass of ``function(leaves)`` to its leaves that need a
    gradient, from random gradients of its outputs ``outs`` (the graph freed on return)."""
    result = function(leaves)
    tensors = [result[key] for key in outs if result[key].requires_grad]
    upstream = [torch.randn_like(t) for t in tensors]
    wanted = [leaf for leaf in leaves.values() if leaf.requires_grad]
    return timed(lambda: torch.autograd.grad(tensors, wanted, upstream, retain_graph=True), reps)


def measure_inputs(staged: StagedStep, reps: int) -> dict[tuple[str, str], float]:
    """The pair geometry stage: forward (pair vectors, adaptive cutoffs, packed rows) and
    backward (the rows' gradients to forces and each pair's virial term, binned as the
    engine's step does)."""
    from ase_tcfp32._neighbors import VIRIAL_BINS

    timed, engine = _timer(staged.device), staged.engine
    positions = staged.positions.detach().requires_grad_(True)
    with torch.enable_grad():
        forward = timed(lambda: staged.inputs(positions), reps)
        packed, vectors = staged.inputs(positions)
        tensors = [packed.vectors, packed.distances, packed.factors]
        upstream = [torch.randn_like(t) for t in tensors]

        def backward():
            forces, pair_grads = torch.autograd.grad(tensors, [positions, vectors], upstream, retain_graph=True)
            terms = (vectors.detach()[:, :, None] * pair_grads[:, None, :]).reshape(-1, 9)
            return forces, terms.new_zeros(VIRIAL_BINS, 9).index_add_(0, engine.pairs.bins, terms)

        return {
            ("pair geometry and cutoffs", "forward"): forward,
            ("pair geometry and cutoffs", "backward"): timed(backward, reps),
        }


# ----- the whole step: its time, its kernels, the launch floor ----------------------------

CATEGORIES = (
    ("gemm", ("fp16x3", "_linear_kernel", "gemm", "sm90_xmma", "cutlass", "cublas")),
    ("attention", ("_packed_forward", "_packed_backward", "_attention_", "_fit_blocks")),
    ("swiglu", ("swiglu",)),
    ("combination", ("combination",)),
    ("cutoffs", ("_solver_kernel",)),
    ("split", ("split", "scale_rows")),
    ("norm", ("norm",)),
    ("index and reductions", ("index", "scatter", "gather", "reduce", "scan", "cumsum", "sort")),
    ("copies and fills", ("copy", "memcpy", "memset", "fill", "cat")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)
"""Kernel categories by substrings of the kernel's name (the first that matches; others: "other")."""


def category(kernel: str) -> str:
    lower = kernel.lower()
    return next((name for name, keys in CATEGORIES if any(k.lower() in lower for k in keys)), "other")


def step_times(calc: TCPETCalculator, atoms, reps: int) -> list[float]:
    """ms of each of ``reps`` energy + forces + stress calculations (after 3 warm-up ones)
    on atoms moved by 1e-4 Å between calls, the device synchronised around each."""
    rng = np.random.default_rng(1)
    atoms = atoms.copy()
    times = []
    for _ in range(reps + 3):
        atoms.positions += rng.normal(0, 1e-4, atoms.positions.shape)
        times.append(1e3 * timed(lambda: calc.calculate(atoms, ["energy", "forces", "stress"], ["positions"])))
    return times[3:]


def profile(calc: TCPETCalculator, atoms, steps: int = 3) -> dict:
    """Kernels per step and GPU-busy ms per step by :data:`CATEGORIES` of ``steps`` steps of
    ``calc`` (warmed up), with ``torch.profiler``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step_times(calc, atoms, 0)  # its warm-up calls
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            calc.calculate(atoms, ["energy", "forces", "stress"], ["positions"])
        torch.cuda.synchronize()
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation and e.device_time > 0
    ]
    by = {}
    for e in kernels:
        key = category(e.name)
        by[key] = by.get(key, 0.0) + e.device_time / 1e3 / steps
    return {
        "kernels_per_step": len(kernels) / steps,
        "gpu_busy_ms": sum(e.device_time for e in kernels) / 1e3 / steps,
        "categories_ms": dict(sorted(by.items(), key=lambda kv: -kv[1])),
    }


def graph_replay_us(kernels: int = 1000, replays: int = 20) -> float:
    """µs per kernel of a replayed CUDA graph of ``kernels`` one-element additions, each
    depending on the one before (what a graph costs per node, beyond the kernels' work)."""
    x = torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * kernels)


# ----- one configuration, the table, the results file --------------------------------------


def analyse(
    shape: str,
    n_atoms: int,
    precisions: list[str],
    device: str,
    reps: int,
    replay_us: float | None,
    measure: bool | None = None,
) -> list:
    """The rows of one model shape and water box: one per precision; with ``measure``
    (default: on CUDA) the measured side too (:func:`measure_step`). A CPU computes with
    fp32 (one calculator's neighbors for every precision's floors)."""
    measure = device == "cuda" if measure is None else measure
    atoms = water_box(n_atoms // 3, seed=0)
    rows = []
    calc = None
    for precision in precisions:
        if calc is None or measure:
            calc = make_calculator(shape, precision, atoms, device)
            counts, candidates = neighbors(calc, atoms)
        stages = model_stages(calc.pet, counts, candidates)
        row = {
            "model": f"random-{shape}",
            "atoms": len(atoms),
            "precision": precision,
            "kept_pairs": int(counts.sum()),
            "mean_neighbors": float(counts.double().mean()),
            "max_neighbors": int(counts.max()),
            "candidate_pairs": candidates,
            "skin": calc._engine.skin,
            "peaks": dict(PEAKS),
            **totals(stages, precision),
        }
        if measure:
            measure_step(calc, atoms, stages, row, reps, replay_us)
        row["stages"] = [
            {
                "name": s.name,
                "kind": s.kind,
                "direction": s.direction,
                "gflop": _figure(s.tensor_core_flops(precision) / 1e9),
                "fp32_gflop": _figure(s.fp32_flops / 1e9),
                "gb": _figure(s.bytes / 1e9),
                "floor_ms": _figure(s.floor_ms(precision)[0]),
                "bound": s.floor_ms(precision)[1],
                "measured_ms": None if s.measured_ms is None else _figure(s.measured_ms),
            }
            for s in stages
        ]
        row["kinds"] = kind_table(row)
        rows.append(row)
        if device == "cuda":
            del calc
            calc = None
            torch.cuda.empty_cache()
    return rows


def _figure(value: float) -> float:
    """``value`` to 5 significant figures (the results file's precision)."""
    return float(f"{value:.5g}")


def measure_step(calc, atoms, stages: list[Stage], row: dict, reps: int, replay_us: float | None) -> None:
    """The measured side of ``row``: the step, its kernels (on CUDA), each stage alone, the
    launch floor (with ``replay_us``, the cost of one kernel of a replayed graph)."""
    row["step_ms"] = statistics.median(step_times(calc, atoms, reps))
    if calc.device.type == "cuda":
        found = profile(calc, atoms)
        row["profiled"] = "as run (graph replay)" if calc._engine.cuda_graphs else "as run (plain launches)"
        if calc._engine.cuda_graphs and found["kernels_per_step"] < 20:  # the profiler saw no kernels in the graph
            plain = make_calculator(row["model"].split("-")[-1], row["precision"], atoms, "cuda", engine="lean")
            found = profile(plain, atoms)
            row["profiled"] = "plain launches (the profiler saw no kernels inside the replayed graph)"
        row.update(found)
    staged = StagedStep(calc, atoms)
    measured = measure_stages(staged, reps)
    reference = _packed_energies(staged)
    row["staged_energy_error"] = float((staged.energies - reference).abs().max() / reference.abs().max())
    for stage in stages:
        stage.measured_ms = measured.get((stage.name, stage.direction))
    row["stages_measured_ms"] = sum(s.measured_ms or 0.0 for s in stages)
    if replay_us is not None and "kernels_per_step" in row:
        row["graph_replay_us"] = replay_us
        row["launch_floor_ms"] = row["kernels_per_step"] * replay_us / 1e3


def _packed_energies(staged: StagedStep) -> torch.Tensor:
    """PET's energies [N, 1] on the staged step's packed rows through ``ase_tcfp32._packed``."""
    from ase_tcfp32 import _packed

    with torch.no_grad():
        return _packed.predictions(staged.backend, staged.packed, ["energy"])[0][0]


def kind_table(row: dict) -> list[dict]:
    """``row``'s stages summed by kind and direction, in the step's order (forward, then backward)."""
    out = {}
    for stage in row["stages"]:
        key = (stage["kind"], stage["direction"])
        into = out.setdefault(
            key,
            {
                "kind": stage["kind"],
                "stage": KINDS[stage["kind"]],
                "direction": stage["direction"],
                "gflop": 0.0,
                "gb": 0.0,
            },
        )
        into["gflop"] += stage["gflop"] + stage["fp32_gflop"]
        into["gb"] += stage["gb"]
        into["floor_ms"] = into.get("floor_ms", 0.0) + stage["floor_ms"]
        if stage["measured_ms"] is not None:
            into["measured_ms"] = into.get("measured_ms", 0.0) + stage["measured_ms"]
    order = {kind: i for i, kind in enumerate(KINDS)}
    return sorted(out.values(), key=lambda r: (r["direction"] == "backward", order[r["kind"]]))


def furthest(row: dict, count: int = 3) -> list[dict]:
    """The ``count`` kinds of stage (per direction) with the most measured time above their floor."""
    measured = [r for r in kind_table(row) if "measured_ms" in r]
    return sorted(measured, key=lambda r: r["floor_ms"] - r["measured_ms"])[:count]


def show(row: dict) -> None:
    """Print ``row``'s table and totals."""
    print(
        f"\nPET-{row['model'].split('-')[-1].upper()} shape, {row['atoms']:,} atoms, {row['precision']}: "
        f"{row['kept_pairs']:,} kept pairs ({row['mean_neighbors']:.1f} per atom, at most {row['max_neighbors']}), "
        f"{row['candidate_pairs']:,} candidates (skin {row['skin']} Å)"
    )
    print(f"{'stage':<56} {'':8} {'GFLOP':>9} {'GB':>8} {'floor ms':>9} {'measured':>9} {'meas/floor':>10}")
    for r in row["kinds"]:
        measured = r.get("measured_ms")
        cells = f"{measured:9.4f} {measured / r['floor_ms']:10.1f}" if measured is not None else ""
        print(f"{r['stage']:<56} {r['direction']:8} {r['gflop']:9.3f} {r['gb']:8.4f} {r['floor_ms']:9.4f} {cells}")
    print(
        f"floors: tensor cores {row['tensor_core_floor_ms']:.2f} ms, memory {row['memory_floor_ms']:.2f} ms, "
        f"sum of stage floors {row['stage_floor_ms']:.2f} ms"
        + (f", launches {row['launch_floor_ms']:.2f} ms" if "launch_floor_ms" in row else "")
    )
    if "step_ms" in row:
        floor = max(row["stage_floor_ms"], row.get("launch_floor_ms", 0.0))
        print(
            f"measured: step {row['step_ms']:.2f} ms ({row['step_ms'] / floor:.1f}x the floor {floor:.2f} ms); "
            f"stages alone {row['stages_measured_ms']:.2f} ms; staged energies vs the package's: "
            f"{row['staged_energy_error']:.1e} relative"
        )
        if "gpu_busy_ms" in row:
            print(
                f"GPU busy {row['gpu_busy_ms']:.2f} ms, {row['kernels_per_step']:.0f} kernels per step (profiled "
                f"{row['profiled']}); by category (ms per step): "
                + ", ".join(f"{k} {v:.2f}" for k, v in row["categories_ms"].items())
            )
        print(
            "furthest above their floors: "
            + "; ".join(
                f"{KINDS[r['kind']]} {r['direction']} ({r['measured_ms']:.2f} vs {r['floor_ms']:.2f} ms)"
                for r in furthest(row)
            )
        )


KEY = ("model", "atoms", "precision")
"""What identifies a row of the results file."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="s,m", help="comma-separated shapes of ase_tcfp32.testing.PET_MAD_SHAPES")
    parser.add_argument("--atoms", default="192,17280", help="comma-separated water-box sizes (whole molecules)")
    parser.add_argument("--precisions", default="fp16x3,tf32x3", help=f"comma-separated: {', '.join(PRODUCTS)}")
    parser.add_argument("--dry-run", action="store_true", help="the floors only: no measurement (any machine)")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions of the step and of each stage")
    parser.add_argument(
        "--out", default=None, help="results file (default: benchmarks/results/speed_of_light_<gpu>.json)"
    )
    args = parser.parse_args()
    precisions = args.precisions.split(",")
    unknown = [p for p in precisions if p not in PRODUCTS]
    if unknown:
        parser.error(f"unknown precisions {unknown}: use {', '.join(PRODUCTS)}")
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    print(f"peaks used: {', '.join(f'{k} {v / 1e12:g} T/s' for k, v in PEAKS.items())} ({PEAKS_SOURCE})")
    replay_us = graph_replay_us() if device == "cuda" else None
    if replay_us is not None:
        print(f"one kernel of a replayed CUDA graph: {replay_us:.2f} µs")
    env = _results.environment(device)
    for shape in args.models.split(","):
        for n_atoms in map(int, args.atoms.split(",")):
            rows = analyse(shape, n_atoms, precisions, device, args.reps, replay_us)
            for row in rows:
                show(row)
            _results.write(
                "speed_of_light", rows, KEY, env=env, out=args.out, note=None if device == "cuda" else "floors only"
            )


if __name__ == "__main__":
    main()

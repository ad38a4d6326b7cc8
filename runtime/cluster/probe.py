"""Measure a node before placing stages on it: one synthetic decoder layer's decode step, free memory, round trips.

The probe needs only the manifest, not the bundle's files (a node may not have them yet): it builds one
decoder layer of the bundle's shape with random weights stored in the bundle's weight format, compiles it
on CPU and times decode steps over a cached context. ``seconds_per_byte`` (step time over the layer's
stored weight bytes) is what the planner (``ovshard.plan.placement``) multiplies stage bytes by: a decode
step of one token reads every weight once, so on a CPU it is bound by how fast the node streams weights.

The weights follow the decompression patterns NNCF writes (and the CPU plugin fuses into a compressed
FullyConnected): fp16 ``Convert``; int8 ``u8 -> Convert -> Subtract zero point -> Multiply scale`` per output
channel; int4 ``u4/i4 [N, K/g, g] -> Convert -> (Subtract) -> Multiply -> Reshape [N, K]`` per group of ``g``.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ovshard import memory
from ovshard.bundle.dims import ModelDims
from ovshard.bundle.manifest import Manifest
from ovshard.bundle.weights import WeightFormat
from ovshard.errors import ConfigError, OvshardError
from ovshard.runtime.wire.address import parse_address

__all__ = ["EchoServer", "ProbeLayer", "build_probe_layer", "free_memory_bytes", "probe_layer", "round_trip_s"]

log = logging.getLogger(__name__)

SEED = 0
WARMUP_STEPS = 3
SAMPLE_S = 0.02  # the shortest timed block of decode steps: several scheduler slices (see probe_layer)
_POOL_ELEMENTS = 1 << 20  # fp32/fp16 weights are windows of one random pool: drawing 60M normals takes 0.7 s


@dataclass(frozen=True)
class ProbeLayer:
    """The synthetic layer: its model, the inputs one decode step reads, and its stored weight bytes."""

    model: ov.Model
    inputs: dict[str, np.ndarray]  # x [1, 1, hidden], past_key / past_value [1, kv_heads, context, head_dim]
    # (latent attention: [1, heads, context, head_dim] and [1, heads, context, v_dim])
    layer_bytes: int  # matrices in the weight format plus the f32 norm scales


class _Weights:
    """Random weight constants in one format, each decompressed to an f32 [out, in] matrix; counts their bytes."""

    def __init__(self, fmt: WeightFormat, seed: int) -> None:
        self.fmt, self.rng, self.bytes = fmt, np.random.default_rng(seed), 0
        dtype = np.float16 if fmt.mode == "fp16" else np.float32
        self.pool = (self.rng.standard_normal(_POOL_ELEMENTS, dtype=np.float32) * 0.02).astype(dtype)

    def _floats(self, shape: tuple[int, ...]) -> np.ndarray:
        """The pool repeated to ``shape``, from a random start: a different window each, so no two constants match."""
        return np.resize(np.roll(self.pool, -int(self.rng.integers(0, _POOL_ELEMENTS))), shape)

    def _const(self, data: np.ndarray, element: ov.Type | None = None, shape: tuple[int, ...] = ()) -> ov.Node:
        """A constant of ``data``; u4/i4 from bytes packed two elements a byte, ``shape`` giving the elements."""
        self.bytes += data.nbytes
        if element is None:
            return ops.constant(data, shared_memory=True)  # the constant keeps ``data`` alive; no copy
        tensor = ov.Tensor(element, ov.Shape(list(shape)))
        tensor.data[:] = data.reshape(-1)
        return ops.constant(tensor)

    def norm(self, size: int) -> ov.Node:
        return self._const(np.ones(size, dtype=np.float32))

    def matrix(self, out_f: int, in_f: int) -> ov.Output:
        """Weight [out_f, in_f] as f32, through the format's decompression subgraph."""
        mode = self.fmt.mode
        if mode == "fp32":
            return self._const(self._floats((out_f, in_f))).output(0)
        if mode == "fp16":
            return ops.convert(self._const(self._floats((out_f, in_f))), ov.Type.f32).output(0)
        group = self.fmt.group_for(in_f)
        if group is None:
            return self._int8(out_f, in_f)
        return self._int4(out_f, in_f, group)

    def _scale(self, shape: tuple[int, ...]) -> ov.Node:
        return self._const(np.full(shape, 0.01, dtype=np.float16))

    def _int8(self, out_f: int, in_f: int) -> ov.Output:
        # u8 [N, K] -> f16, minus a u8 zero point [N, 1], times an f16 scale [N, 1] -> f32
        w = ops.convert(self._const(self.rng.integers(0, 256, (out_f, in_f), dtype=np.uint8)), ov.Type.f16)
        zero = ops.convert(self._const(np.full((out_f, 1), 128, dtype=np.uint8)), ov.Type.f16)
        return ops.convert(ops.multiply(ops.subtract(w, zero), self._scale((out_f, 1))), ov.Type.f32).output(0)

    def _int4(self, out_f: int, in_f: int, group: int) -> ov.Output:
        # u4 (asym) or i4 (sym) [N, K/g, g] -> f16, (minus a u4 zero point [N, K/g, 1]), times an f16 scale
        # [N, K/g, 1] -> reshape [N, K] -> f32
        groups = in_f // group
        packed = self.rng.integers(0, 256, (out_f * in_f + 1) // 2, dtype=np.uint8)
        asym = self.fmt.mode == "int4_asym"
        element = ov.Type.u4 if asym else ov.Type.i4
        w = ops.convert(self._const(packed, element, (out_f, groups, group)), ov.Type.f16)
        if asym:
            zero_bytes = np.full((out_f * groups + 1) // 2, 0x88, dtype=np.uint8)  # zero point 8 in both nibbles
            w = ops.subtract(w, ops.convert(self._const(zero_bytes, ov.Type.u4, (out_f, groups, 1)), ov.Type.f16))
        scaled = ops.multiply(w, self._scale((out_f, groups, 1)))
        flat = ops.reshape(scaled, ops.constant(np.array([out_f, in_f], dtype=np.int64)), special_zero=False)
        return ops.convert(flat, ov.Type.f32).output(0)


def _rms(x: ov.Output, weight: ov.Node, eps: float) -> ov.Output:
    axis = ops.constant(np.array([-1], dtype=np.int64))
    mean = ops.reduce_mean(ops.multiply(x, x), axis, keep_dims=True)
    inv = ops.divide(ops.constant(np.float32(1.0)), ops.sqrt(ops.add(mean, ops.constant(np.float32(eps)))))
    return ops.multiply(ops.multiply(x, inv), weight).output(0)


def _linear(x: ov.Output, w: ov.Output) -> ov.Output:
    return ops.matmul(x, w, transpose_a=False, transpose_b=True).output(0)


def _heads(x: ov.Output, heads: int, head_dim: int) -> ov.Output:
    """[1, 1, heads * head_dim] -> [1, heads, 1, head_dim]."""
    split = ops.reshape(x, ops.constant(np.array([1, 1, heads, head_dim], dtype=np.int64)), special_zero=False)
    return ops.transpose(split, ops.constant(np.array([0, 2, 1, 3], dtype=np.int64))).output(0)


def _repeat_kv(kv: ov.Output, dims: ModelDims, length: int) -> ov.Output:
    """[1, kv_heads, length, head_dim] -> [1, heads, length, head_dim] (each KV head serves kv_groups heads)."""
    if dims.kv_groups == 1:
        return kv
    wide = ops.unsqueeze(kv, ops.constant(np.array([2], dtype=np.int64)))  # [1, kv_heads, 1, length, head_dim]
    target = np.array([1, dims.num_kv_heads, dims.kv_groups, length, dims.head_dim], dtype=np.int64)
    wide = ops.broadcast(wide, ops.constant(target))
    shape = np.array([1, dims.num_heads, length, dims.head_dim], dtype=np.int64)
    return ops.reshape(wide, ops.constant(shape), special_zero=False).output(0)


def _attention(weights: _Weights, normed: ov.Output, dims: ModelDims, context: int) -> tuple[ov.Output, list]:
    """Grouped-query attention of the new token over ``context`` cached ones: ([1, 1, heads * head_dim], the two
    cache parameters [1, kv_heads, context, head_dim])."""
    h, q_out, kv_out = dims.hidden_size, dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    past = [ops.parameter([1, dims.num_kv_heads, context, dims.head_dim], ov.Type.f32, name=n)
            for n in ("past_key", "past_value")]
    q = _heads(_linear(normed, weights.matrix(q_out, h)), dims.num_heads, dims.head_dim)
    kv = []
    for cache in past:  # the new token's key / value joins the cache: [1, kv_heads, context + 1, head_dim]
        new = _heads(_linear(normed, weights.matrix(kv_out, h)), dims.num_kv_heads, dims.head_dim)
        kv.append(_repeat_kv(ops.concat([cache, new], axis=2).output(0), dims, context + 1))
    attn = ops.scaled_dot_product_attention(q, kv[0], kv[1], causal=False)  # [1, heads, 1, head_dim]
    return _merge_heads(attn.output(0), q_out), past


def _mla_attention(weights: _Weights, normed: ov.Output, dims: ModelDims, context: int) -> tuple[ov.Output, list]:
    """Multi-head latent attention (DeepSeek-V3) at the config's own widths: queries through the q_lora_rank
    latent (or one q projection), kv_a to the kv_lora_rank latent plus the shared rope_head_dim rotary key, kv_b
    from the normed latent to every head's nope key and value, keys of head_dim (nope + rope) and values of
    v_dim cached expanded per head. Returns ([1, 1, heads * v_dim], the two cache parameters)."""
    h, heads, rope = dims.hidden_size, dims.num_heads, dims.rope_head_dim
    nope, latent = dims.head_dim - rope, dims.kv_lora_rank
    past = [ops.parameter([1, heads, context, width], ov.Type.f32, name=n)
            for n, width in (("past_key", dims.head_dim), ("past_value", dims.v_dim))]
    if dims.q_lora_rank:
        q_latent = _rms(_linear(normed, weights.matrix(dims.q_lora_rank, h)), weights.norm(dims.q_lora_rank),
                        dims.rms_norm_eps)
        q_flat = _linear(q_latent, weights.matrix(heads * dims.head_dim, dims.q_lora_rank))
    else:
        q_flat = _linear(normed, weights.matrix(heads * dims.head_dim, h))
    q = _heads(q_flat, heads, dims.head_dim)
    compressed = _linear(normed, weights.matrix(latent + rope, h))  # [1, 1, latent + rope]
    kv_latent, k_rope = ops.variadic_split(compressed, ops.constant(np.int64(-1)),
                                           ops.constant(np.array([latent, rope], dtype=np.int64))).outputs()
    kv_latent = _rms(kv_latent, weights.norm(latent), dims.rms_norm_eps)
    expanded = _heads(_linear(kv_latent, weights.matrix(heads * (nope + dims.v_dim), latent)), heads,
                      nope + dims.v_dim)  # [1, heads, 1, nope + v_dim]
    k_nope, value = ops.variadic_split(expanded, ops.constant(np.int64(-1)),
                                       ops.constant(np.array([nope, dims.v_dim], dtype=np.int64))).outputs()
    k_rope = ops.broadcast(_heads(k_rope, 1, rope), ops.constant(np.array([1, heads, 1, rope], dtype=np.int64)))
    key = ops.concat([k_nope, k_rope], axis=-1)  # [1, heads, 1, head_dim]
    k_all, v_all = (ops.concat([cache, new], axis=2) for cache, new in zip(past, (key, value), strict=True))
    attn = ops.scaled_dot_product_attention(q, k_all, v_all, causal=False)  # [1, heads, 1, v_dim]
    return _merge_heads(attn.output(0), heads * dims.v_dim), past


def _merge_heads(attn: ov.Output, width: int) -> ov.Output:
    """[1, heads, 1, dim] -> [1, 1, heads * dim]."""
    attn = ops.transpose(attn, ops.constant(np.array([0, 2, 1, 3], dtype=np.int64)))
    return ops.reshape(attn, ops.constant(np.array([1, 1, width], dtype=np.int64)), special_zero=False).output(0)


def build_probe_layer(dims: ModelDims, fmt: WeightFormat, context: int = 256, seed: int = SEED) -> ProbeLayer:
    """One decoder layer of ``dims`` with weights in ``fmt``, attending over ``context`` cached tokens: Llama's
    (grouped-query attention, a gated MLP of intermediate_size), with latent attention at its own widths where
    ``dims.mla``."""
    weights = _Weights(fmt, seed)
    h = dims.hidden_size
    x = ops.parameter([1, 1, h], ov.Type.f32, name="x")
    normed = _rms(x.output(0), weights.norm(h), dims.rms_norm_eps)
    attn, past = (_mla_attention if dims.mla else _attention)(weights, normed, dims, context)
    attn_width = attn.get_partial_shape()[-1].get_length()
    x2 = ops.add(x, _linear(attn, weights.matrix(h, attn_width)))
    normed2 = _rms(x2.output(0), weights.norm(h), dims.rms_norm_eps)
    gate = ops.swish(_linear(normed2, weights.matrix(dims.intermediate_size, h)))
    up = _linear(normed2, weights.matrix(dims.intermediate_size, h))
    out = ops.add(x2, _linear(ops.multiply(gate, up).output(0), weights.matrix(h, dims.intermediate_size)))
    model = ov.Model([ops.result(out)], [x, *past], "ovshard_probe_layer")
    rng = np.random.default_rng(seed + 1)
    inputs = {"x": rng.standard_normal((1, 1, h), dtype=np.float32)}
    for p in past:
        inputs[p.get_friendly_name()] = rng.standard_normal(p.get_output_shape(0), dtype=np.float32)
    return ProbeLayer(model, inputs, weights.bytes)


def probe_layer(manifest: Manifest, threads: int | None = None, steps: int = 12, context: int = 256) -> dict:
    """Time one decoder layer of the bundle's shape and format on this node's CPU.

    Returns {"step_s": median seconds of one decode step, "layer_bytes": the layer's stored weight bytes,
    "seconds_per_byte": step_s / layer_bytes, "threads": threads or 0 (the plugin's default),
    "free_bytes": MemAvailable before the probe}. Plain data, so a Ray actor can return it.
    """
    if steps < 1 or context < 1 or (threads is not None and threads < 1):
        raise ConfigError(f"probe_layer(steps={steps}, context={context}, threads={threads}): expected steps >= 1, "
                          "context >= 1 and threads >= 1 (or None for the plugin's default)")
    start, free = time.perf_counter(), free_memory_bytes()  # before the probe's own weights take memory
    layer = build_probe_layer(manifest.architecture, manifest.weights, context)
    config = {"INFERENCE_NUM_THREADS": threads} if threads else {}
    request = ov.Core().compile_model(layer.model, "CPU", config).create_infer_request()
    for name, value in layer.inputs.items():
        request.set_tensor(name, ov.Tensor(value))
    # In a stage of many layers each layer's weights are out of cache when its turn comes; a layer that the
    # last-level cache could hold would time 10-30% faster step after step, so read a buffer twice the
    # cache's size (~5 ms) before each timed step
    evict = np.ones(2 * _last_level_cache_bytes(), dtype=np.uint8)
    cached = layer.layer_bytes < evict.nbytes
    for _ in range(WARMUP_STEPS):
        t0 = time.perf_counter()
        request.infer()
    # A step far shorter than the scheduler's time slice runs whole inside one slice, so it cannot see another
    # process sharing the core (a busy node would probe as fast as an idle one): time blocks of back-to-back
    # steps lasting at least SAMPLE_S each, and take a step as a block's time over its steps
    repeat = max(1, math.ceil(SAMPLE_S / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(steps):
        if cached:
            evict.max()
        t0 = time.perf_counter()
        for _ in range(repeat):
            request.infer()
        times.append((time.perf_counter() - t0) / repeat)
    step_s = statistics.median(times)
    log.info("probe: %s layer of hidden %d, %d threads: %.2f ms a step (%.2f s in all)", manifest.weights.mode,
             manifest.architecture.hidden_size, threads or 0, step_s * 1e3, time.perf_counter() - start)
    return {"step_s": step_s, "layer_bytes": layer.layer_bytes, "seconds_per_byte": step_s / layer.layer_bytes,
            "threads": threads or 0, "free_bytes": free}


def _last_level_cache_bytes() -> int:
    """Size of CPU 0's last-level cache from sysfs ("32768K"), or 32 MiB where sysfs does not say."""
    found: dict[int, int] = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
            found[level] = int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]] if size[-1] in "KM" else int(size)
        except (OSError, ValueError):
            continue
    return found[max(found)] if found else 32 << 20


def free_memory_bytes() -> int:
    """Memory available to new work: MemAvailable from /proc/meminfo, else free pages times the page size."""
    available = memory.available_bytes()
    if available is None:
        available = int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    return available


class EchoServer:
    """Echoes every byte back, so another node can time round trips to this one (``round_trip_s``).

    Bound to all interfaces by default: peers reach it at this node's address and ``port``.
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0) -> None:
        self._sock = socket.create_server((host, port))
        self.host, self.port = host, int(self._sock.getsockname()[1])
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name="ovshard-probe-echo", daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._echo, args=(conn,), name="ovshard-probe-echo-conn", daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(4096):
                conn.sendall(data)
        except OSError:
            pass  # the peer went away, or close() shut the connection
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop listening and end open connections."""
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        for sock in (self._sock, *conns):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept() or recv()
            except OSError:
                pass
        self._sock.close()  # each connection's own thread closes it as it leaves (transport.Connection says why)

    def __enter__(self) -> EchoServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def round_trip_s(address: str, tries: int = 5, timeout_s: float = 5.0) -> float:
    """Median seconds for one byte to go to the EchoServer at ``address`` ("host:port") and back, connect excluded."""
    host, port = parse_address(address)
    if tries < 1:
        raise ConfigError(f"round_trip_s({address!r}, tries={tries}): expected tries >= 1")
    fix = (f"the probe's echo port must be open between nodes (firewall, security group): allow TCP to port {port} "
           f"on {host} from this node")
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise OvshardError(f"cannot reach the probe echo server at {address} ({e}); {fix}") from e
    times = []
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for _ in range(tries):
                t0 = time.perf_counter()
                sock.sendall(b"\x01")
                if sock.recv(1) != b"\x01":
                    raise OSError("the connection closed before the byte came back")
                times.append(time.perf_counter() - t0)
        except OSError as e:
            raise OvshardError(f"the probe echo server at {address} stopped answering ({e}); {fix}") from e
    return statistics.median(times)

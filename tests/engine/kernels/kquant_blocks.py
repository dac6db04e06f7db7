"""K-quant blocks (Q4_K, Q5_K, Q6_K) made with numpy for the tests: gguf-py dequantizes these
types but has no quantizer for them. random_blocks draws any byte pattern with small finite
fp16 scales (every such pattern is a valid block); quantize is a plain min/max encoder in
ggml's layouts, near enough to the weights for a model to behave like its float self."""

from __future__ import annotations

import numpy as np

QK = 256
BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def random_blocks(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row bytes]: random codes and scales, fp16 d (and dmin) ~ 1e-3."""
    raw = rng.integers(0, 256, size=(n, k // QK, BYTES[name]), dtype=np.uint8)
    d = (rng.standard_normal((n, k // QK, 2)) * 1e-3).astype(np.float16).view(np.uint8)
    if name == "Q6_K":
        raw[..., 208:210] = d[..., :2]
    else:
        raw[..., 0:4] = d.reshape(n, k // QK, 4)
    return raw.reshape(n, -1)


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _q45(w: np.ndarray, bits: int) -> np.ndarray:
    """w [S, 256] -> Q4_K / Q5_K superblocks [S, bytes]."""
    top = (1 << bits) - 1
    sub = w.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / top  # [S, 8]
    d = _f16(scale.max(-1) / 63)
    dmin = _f16(-lo.min(-1) / 63)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(scale / np.where(d32 > 0, d32, 1)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / np.where(dmin32 > 0, dmin32, 1)), 0, 63).astype(np.uint8)
    step = (d32 * sc)[..., None]
    q = np.round((sub + (dmin32 * m)[..., None]) / np.where(step > 0, step, 1))
    q = np.clip(q, 0, top).astype(np.uint8).reshape(-1, 4, 2, 32)  # [S, pair, lo/hi, 32]
    scales = np.empty((w.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    qs = ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(-1, 128)
    parts = [d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales]
    if bits == 5:  # bit j of qh[l]: sub-block j's weight l, 5th bit
        hi = (q.reshape(-1, 8, 32) >> 4) & 1
        parts.append((hi << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8))
    return np.concatenate([*parts, qs], axis=1)


def _q6(w: np.ndarray) -> np.ndarray:
    """w [S, 256] -> Q6_K superblocks [S, 210]."""
    sub = w.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31  # [S, 16]
    d = _f16(scale.max(-1) / 127)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(scale / np.where(d32 > 0, d32, 1)), -128, 127).astype(np.int8)
    step = (d32 * sc)[..., None]
    q = np.clip(np.round(sub / np.where(step > 0, step, 1)) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # [S, half, quarter, 32]
    ql = np.concatenate(
        [(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)],
        axis=2,
    ).reshape(-1, 128)  # fmt: skip
    qh = sum((q[:, :, i] >> 4) << (2 * i) for i in range(4)).astype(np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d[:, None].view(np.uint8)], axis=1)


def quantize(w: np.ndarray, name: str) -> np.ndarray:
    """w [n, k] float (k % 256 == 0) -> uint8 [n, row bytes] in ggml's layout of `name`."""
    n, k = w.shape
    sb = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, QK)
    raw = _q6(sb) if name == "Q6_K" else _q45(sb, 4 if name == "Q4_K" else 5)
    assert raw.shape[1] == BYTES[name]
    return np.ascontiguousarray(raw.reshape(n, -1))

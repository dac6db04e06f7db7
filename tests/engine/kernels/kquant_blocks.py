"""K-quant, IQ4 and NVFP4 blocks (Q4_K, Q5_K, Q6_K, IQ4_XS; IQ4_NL; NVFP4) made with numpy for
the tests: gguf-py dequantizes these types but has no quantizer for them. random_blocks draws any byte
pattern with small finite fp16 scales (every such pattern is a valid block); quantize is a
plain min/max (IQ4: nearest grid value) encoder in ggml's layouts, near enough to the weights
for a model to behave like its float self."""

from __future__ import annotations

import numpy as np

QK = 256
BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136}
_SCALE_AT = {"Q2_K": 80, "Q3_K": 108, "Q6_K": 208}  # the fp16 d (Q2_K: d, dmin); else at 0
TYPES = (*BYTES, "IQ4_NL", "NVFP4")  # what quantize encodes
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


def random_blocks(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row bytes]: random codes and scales, fp16 d (and dmin) ~ 1e-3."""
    raw = rng.integers(0, 256, size=(n, k // QK, BYTES[name]), dtype=np.uint8)
    d = (rng.standard_normal((n, k // QK, 2)) * 1e-3).astype(np.float16).view(np.uint8)
    at = _SCALE_AT.get(name, 0)
    width = 2 if name in ("Q3_K", "Q6_K") else 4
    raw[..., at : at + width] = d.reshape(n, k // QK, 4)[..., :width]
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


def _two_bits(q: np.ndarray) -> np.ndarray:
    """codes [S, 256] (their low 2 bits) -> 64 bytes: weight 128h + 32t + l at bits 2t of
    byte 32h + l."""
    q = (q & 3).reshape(-1, 2, 4, 32).astype(np.uint8)
    return sum(q[:, :, t] << (2 * t) for t in range(4)).astype(np.uint8).reshape(-1, 64)


def _q2(w: np.ndarray) -> np.ndarray:
    """w [S, 256] -> Q2_K superblocks [S, 84]: per 16 a 4-bit scale and minimum."""
    sub = w.reshape(-1, 16, 16)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / 3
    d, dmin = _f16(scale.max(-1) / 15), _f16(-lo.min(-1) / 15)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(scale / np.where(d32 > 0, d32, 1)), 0, 15).astype(np.uint8)
    m = np.clip(np.round(-lo / np.where(dmin32 > 0, dmin32, 1)), 0, 15).astype(np.uint8)
    step = (d32 * sc)[..., None]
    q = np.clip(np.round((sub + (dmin32 * m)[..., None]) / np.where(step > 0, step, 1)), 0, 3)
    parts = [sc | (m << 4), _two_bits(q.astype(np.uint8).reshape(-1, 256))]
    return np.concatenate([*parts, d[:, None].view(np.uint8), dmin[:, None].view(np.uint8)], 1)


def _q3(w: np.ndarray) -> np.ndarray:
    """w [S, 256] -> Q3_K superblocks [S, 110]: per 16 a signed 6-bit scale, codes -4..3."""
    sub = w.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 4
    d = _f16(scale.max(-1) / 31)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(scale / np.where(d32 > 0, d32, 1)), -32, 31).astype(np.int64)
    step = (d32 * sc)[..., None]
    q = np.clip(np.round(sub / np.where(step != 0, step, 1)), -4, 3).astype(np.int64) + 4
    q = q.reshape(-1, 256).astype(np.uint8)  # 0..7: bit 2 is hmask's
    hmask = sum(((q[:, 32 * k : 32 * k + 32] >> 2) & 1) << k for k in range(8)).astype(np.uint8)
    s6 = (sc + 32).astype(np.uint8)  # [S, 16]
    scales = np.empty((w.shape[0], 12), np.uint8)
    scales[:, :8] = (s6[:, :8] & 15) | ((s6[:, 8:] & 15) << 4)
    scales[:, 8:] = sum(((s6[:, 4 * a : 4 * a + 4] >> 4) & 3) << (2 * a) for a in range(4))
    return np.concatenate([hmask, _two_bits(q), scales, d[:, None].view(np.uint8)], 1)


def _iq4_codes(sub: np.ndarray, step: np.ndarray) -> np.ndarray:
    """sub [..., 32] / step [...] -> the nearest grid values' codes, packed as ggml packs a
    block: byte l holds weight l's code (low nibble) and weight l + 16's (high) -> [..., 16]."""
    t = sub / np.where(step != 0, step, 1)[..., None]
    q = np.abs(t[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _iq4_nl(w: np.ndarray) -> np.ndarray:
    """w [B, 32] -> IQ4_NL blocks [B, 18]: the largest |w| on the grid's -127."""
    big = np.take_along_axis(w, np.abs(w).argmax(-1)[:, None], -1)[:, 0]
    d = _f16(big / -127)
    return np.concatenate([d[:, None].view(np.uint8), _iq4_codes(w, d.astype(np.float32))], 1)


def _iq4_xs(w: np.ndarray) -> np.ndarray:
    """w [S, 256] -> IQ4_XS superblocks [S, 136]: each sub-block's scale as IQ4_NL's, then
    d * (ls - 32) with ls 6 bits."""
    sub = w.reshape(-1, 8, 32)
    big = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    dl = big / -127  # [S, 8]
    d = _f16(np.abs(dl).max(-1) / 32)
    d32 = d.astype(np.float32)[:, None]
    ls = (np.clip(np.round(dl / np.where(d32 > 0, d32, 1)), -32, 31) + 32).astype(np.uint16)
    qs = _iq4_codes(sub, d32 * (ls.astype(np.float32) - 32)).reshape(-1, 128)
    high = (((ls >> 4) & 3) << (2 * np.arange(8, dtype=np.uint16))).sum(1).astype(np.uint16)
    low = (ls & 15).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
    parts = [d[:, None].view(np.uint8), high[:, None].view(np.uint8), scales_l, qs]
    return np.concatenate(parts, axis=1)


def _nvfp4(w: np.ndarray) -> np.ndarray:
    """w [S, 64] -> NVFP4 superblocks [S, 36]: per 16 values a ue4m3 byte (gguf-py's encoder,
    of max |w| / 6, the e2m1 range), then the nearest doubled e2m1 values' codes, 8 bytes a
    sub-block (values 0-7 in the low nibbles, 8-15 in the high)."""
    from gguf.quants import NVFP4

    sub = w.reshape(-1, 4, 16)
    d = NVFP4.fp32_to_ue4m3(np.abs(sub).max(-1) / 6)  # [S, 4]
    half = NVFP4.ue4m3_to_fp32(d)  # what the kernel multiplies the doubled values by
    t = sub / np.where(half > 0, half, 1)[..., None]
    values = np.array(NVFP4.kvalues, dtype=np.float32)
    q = np.abs(t[..., None] - values).argmin(-1).astype(np.uint8)  # [S, 4, 16]
    codes = q[..., :8] | (q[..., 8:] << 4)
    return np.concatenate([d.astype(np.uint8), codes.reshape(-1, 32)], 1)


def quantize(w: np.ndarray, name: str) -> np.ndarray:
    """w [n, k] float (k % 256 == 0; IQ4_NL k % 32, NVFP4 k % 64) -> uint8 [n, row bytes] in
    ggml's layout of `name`."""
    n, k = w.shape
    if name == "NVFP4":
        raw = _nvfp4(np.ascontiguousarray(w, dtype=np.float32).reshape(-1, 64))
        return np.ascontiguousarray(raw.reshape(n, -1))
    if name == "IQ4_NL":
        raw = _iq4_nl(np.ascontiguousarray(w, dtype=np.float32).reshape(-1, 32))
        return np.ascontiguousarray(raw.reshape(n, -1))
    sb = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, QK)
    if name in ("IQ4_XS", "Q2_K", "Q3_K"):
        raw = {"IQ4_XS": _iq4_xs, "Q2_K": _q2, "Q3_K": _q3}[name](sb)
    else:
        raw = _q6(sb) if name == "Q6_K" else _q45(sb, 4 if name == "Q4_K" else 5)
    assert raw.shape[1] == BYTES[name]
    return np.ascontiguousarray(raw.reshape(n, -1))

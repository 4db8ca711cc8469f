"""CPU emulation of the shared-memory layout, matrix descriptors and fragment maps of the
Hopper dK/dV kernel (csrc/attention/cuda/cod_attn_bwd_wgmma.cuh and the building
blocks in cod_attn_wgmma.cuh), the only check of that address math possible without a GPU.

Hardware model (PTX ISA "asynchronous warpgroup level matrix shared memory layout" and the canonical
layouts as documented by CuTe's make_gmma_desc, in 16-byte units, composed with the 128-byte swizzle
Swizzle<3,4,3>: byte address bits [4, 7) ^= bits [7, 10) of the absolute shared-memory address):
  descriptor: bits 0-13 start >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, 49-51 base offset, 62-63 swizzle
  K-major B128, element (r, k) of an (M or N) x 16 operand, k contiguous:
      start + (r % 8) * 128 + (r // 8) * SBO + 2 k                    (LBO unused)
  MN-major B128, element (k, n) of a 16 x N operand, n contiguous:
      start + (k % 8) * 128 + (k // 8) * SBO + 2 (n % 64) + (n // 64) * LBO
  accumulator m64nN f32: warp w, lane (g, t), register 4 n + x = (16 w + g + 8 (x >> 1), 8 n + 2 t + (x & 1))
  RS A fragment (per warp, rows 16 w ..): a0 (g, 2t..2t+1) a1 (g+8, 2t..) a2 (g, 2t+8..) a3 (g+8, 2t+8..)
Checks (D, BMQ) = (128, 64) and (64, 64), the kernel's configurations:
 1. the tile writer (load_tile_sw128: thread -> (row, chunk) -> sw128_offset) and the descriptor reads
    agree element by element for every k-step of S^T = K Q^T, dP^T = V dO^T (K-major) and of
    dV += P^T dO, dK += dS^T Q (MN-major), incl. the packed descriptor bits;
 2. one kernel iteration (S^T, dP^T, P^T = S^T here, the A-fragment packing, dV, dK) through these
    maps equals the plain matrix products (float64);
 3. the swizzle keeps 16-byte chunks whole and is a bijection on each 1024-byte atom; every atom and
    every descriptor start is where the model assumes (1024-aligned atoms, base offset 0), the
    shared-memory carve-up (1024-byte alignment slack included) fits DkvWgmmaConfig::kSmemBytes
    and the H200's 227 KiB; cp.async writes of a warp phase are bank-conflict-free.
Also the wgmma dQ kernel (cod_attn_dq_wgmma.cuh, D = 128 and 64): its carve-up (DqWgmmaConfig: Q, dO
[64][D], 2 stages of K, V [64][D], metadata, chain scratch for K = 64; 2 CTAs per SM at K = 8), the
K-major reads of S = Q K^T, dP = dO V^T, the MN-major read of the same K tile for dQ += dS K
(LBO = 64 * 128), and one key block through the fragment maps against the plain products.
Run: python tools/kernels/emulate_attn_wgmma_layout.py   (prints 'ok' or raises)."""

import numpy as np

BN, NT, MF, KMAXCHAIN = 64, 128, 7, 64


# ---------------------------------------------------------------- the kernel's side (mirrors C++)
def sw128_offset(rows, row, chunk):  # cod_attn_wgmma.cuh sw128_offset<ROWS>
    assert rows % 8 == 0
    return (chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4)


def make_desc_b128(addr, lbo, sbo):  # make_desc_b128
    return ((addr & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16) | (((sbo & 0x3FFFF) >> 4) << 32) | (1 << 62)


def desc_kmajor(rows, tile, kk):
    return make_desc_b128(tile + (kk >> 2) * rows * 128 + (kk & 3) * 32, 16, 1024)


def desc_mnmajor(rows, tile, kq):
    return make_desc_b128(tile + kq * 2048, rows * 128, 1024)


def smem_config(d, bmq):  # DkvWgmmaConfig
    ktile, qtile = BN * d * 2, bmq * d * 2
    tiles = 2 * ktile + 4 * qtile
    return dict(ktile=ktile, qtile=qtile, tiles=tiles, smem=1024 + tiles + (2 * MF * bmq + 6 * KMAXCHAIN + 1) * 4)


# ---------------------------------------------------------------- hardware model
def decode(desc):
    start = (desc & 0x3FFF) << 4
    lbo = ((desc >> 16) & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    base_off = (desc >> 49) & 7
    swz = (desc >> 62) & 3
    assert swz == 1 and base_off == 0, "model covers 128-byte swizzle with base offset 0 only"
    return start, lbo, sbo


def swizzle128(addr):
    return addr ^ (((addr >> 7) & 7) << 4)


def hw_kmajor(smem, desc, rows):
    """operand [rows][16] as the tensor core reads it (K-major B128)"""
    start, _, sbo = decode(desc)
    out = np.empty((rows, 16))
    for r in range(rows):
        for k in range(16):
            a = swizzle128(start + (r % 8) * 128 + (r // 8) * sbo + 2 * k)
            out[r, k] = smem.read(a)
    return out


def hw_mnmajor(smem, desc, n_cols):
    """operand [16][n_cols] as the tensor core reads it (MN-major B128)"""
    start, lbo, sbo = decode(desc)
    out = np.empty((16, n_cols))
    for k in range(16):
        for n in range(n_cols):
            a = swizzle128(start + (k % 8) * 128 + (k // 8) * sbo + 2 * (n % 64) + (n // 64) * lbo)
            out[k, n] = smem.read(a)
    return out


class Smem:
    def __init__(self, nbytes):
        self.h = np.full(nbytes // 2, np.nan)
        self.written = np.zeros(nbytes // 2, dtype=bool)

    def write16(self, addr, vals):  # one 16-byte chunk
        assert addr % 16 == 0
        i = addr // 2
        assert not self.written[i : i + 8].any(), "chunk written twice"
        self.h[i : i + 8] = vals
        self.written[i : i + 8] = True

    def read(self, addr):
        assert addr % 2 == 0
        v = self.h[addr // 2]
        assert not np.isnan(v), f"read of unwritten shared memory at {addr}"
        return v


def load_tile_sw128(smem, tile_addr, mat, rows, d, first, limit):
    """load_tile_sw128<ROWS, D, NT>: thread tid, iteration it -> idx -> (r, c); zero fill outside"""
    chunks = d // 8
    total = rows * chunks
    assert total % NT == 0
    banks = {}
    for it in range(total // NT):
        for tid in range(NT):
            idx = tid + it * NT
            r, c = idx // chunks, idx % chunks
            g = first + r
            vals = mat[g, 8 * c : 8 * c + 8] if 0 <= g < limit else np.zeros(8)
            a = tile_addr + sw128_offset(rows, r, c)
            smem.write16(a, vals)
            # bank groups of one 8-thread phase of a 16-byte store
            banks.setdefault((it, tid // 8), []).append((a // 16) % 8)
    for key, b in banks.items():
        assert len(set(b)) == len(b), f"cp.async phase {key} has a bank conflict: {b}"


# ---------------------------------------------------------------- checks
def check_swizzle():
    for rows in (32, 64):
        for d in (64, 128):
            offs = [sw128_offset(rows, r, c) for r in range(rows) for c in range(d // 8)]
            assert len(set(offs)) == len(offs) and min(offs) == 0 and max(offs) == rows * d * 2 - 16
            assert all(o % 16 == 0 for o in offs)
            # the written layout equals the hardware swizzle of the plain (unswizzled) panel layout
            for r in range(rows):
                for c in range(d // 8):
                    plain = (c >> 3) * rows * 128 + r * 128 + (c & 7) * 16
                    assert swizzle128(plain) == sw128_offset(rows, r, c)


def check_config(d, bmq, rng):
    cfg = smem_config(d, bmq)
    assert cfg["smem"] <= 227 * 1024
    for raw in range(0, 4096, 16):  # any 16-byte aligned dynamic shared memory base
        base = (raw + 1023) & ~1023
        assert base - raw + cfg["tiles"] + (2 * MF * bmq + 6 * KMAXCHAIN + 1) * 4 <= cfg["smem"]
    # every tile (and panel) base is a multiple of 1024 given a 1024-aligned base
    for off in (
        0,
        cfg["ktile"],
        2 * cfg["ktile"],
        2 * cfg["ktile"] + cfg["qtile"],
        2 * cfg["ktile"] + 2 * cfg["qtile"],
        2 * cfg["ktile"] + 3 * cfg["qtile"],
    ):
        assert off % 1024 == 0
    for rows in (BN, bmq):
        assert (rows * 128) % 1024 == 0

    # a CTA's smem at a 1024-aligned base well inside the 256 KiB descriptor address range
    base = 0x1400
    sK, sV = base, base + cfg["ktile"]
    sQ, sdO = base + 2 * cfg["ktile"], base + 2 * cfg["ktile"] + 2 * cfg["qtile"]
    stage = 1  # the second stage: a non-zero stage offset
    qt, dot = sQ + stage * cfg["qtile"], sdO + stage * cfg["qtile"]
    smem = Smem(base + cfg["tiles"] + 4096)
    n_keys, n_q = 100, 70
    K, V = rng.standard_normal((n_keys, d)), rng.standard_normal((n_keys, d))
    Q, dO = rng.standard_normal((n_q, d)), rng.standard_normal((n_q, d))
    j0, i0, iend = 64, 40, 61  # a partial key block (rows >= N zero) and a partial query run
    load_tile_sw128(smem, sK, K, BN, d, j0, n_keys)
    load_tile_sw128(smem, sV, V, BN, d, j0, n_keys)
    load_tile_sw128(smem, qt, Q, bmq, d, i0, iend)
    load_tile_sw128(smem, dot, dO, bmq, d, i0, iend)

    def rows_of(mat, first, limit, rows):
        out = np.zeros((rows, d))
        for r in range(rows):
            if 0 <= first + r < limit:
                out[r] = mat[first + r]
        return out

    Kt, Vt = rows_of(K, j0, n_keys, BN), rows_of(V, j0, n_keys, BN)
    Qt, dOt = rows_of(Q, i0, iend, bmq), rows_of(dO, i0, iend, bmq)

    # 1. descriptor reads == the logical operands, every k-step
    for kk in range(d // 16):
        for desc_fn_tile, rows, ref in ((sK, BN, Kt), (sV, BN, Vt), (qt, bmq, Qt), (dot, bmq, dOt)):
            desc = desc_kmajor(rows, desc_fn_tile, kk)
            assert decode(desc)[0] == desc_fn_tile + (kk >> 2) * rows * 128 + (kk & 3) * 32
            got = hw_kmajor(smem, desc, rows)
            assert np.array_equal(got, ref[:, 16 * kk : 16 * kk + 16]), f"K-major read kk={kk} rows={rows}"
    for kq in range(bmq // 16):
        for tile, ref in ((dot, dOt), (qt, Qt)):
            desc = desc_mnmajor(bmq, tile, kq)
            start, lbo, sbo = decode(desc)
            assert (start, lbo, sbo) == (tile + 2048 * kq, bmq * 128, 1024)
            got = hw_mnmajor(smem, desc, d)
            assert np.array_equal(got, ref[16 * kq : 16 * kq + 16, :]), f"MN-major read kq={kq}"

    # 2. one iteration through the fragment maps
    def ss(acc_n, desc_a, desc_b):  # m64 x acc_n accumulators for D/16 k-steps
        return sum(hw_kmajor(smem, desc_a(kk), BN) @ hw_kmajor(smem, desc_b(kk), acc_n).T for kk in range(d // 16))

    def to_frag(mat, n_cols):  # [64][n] -> frag[w][lane][n8][x]
        f = np.empty((4, 32, n_cols // 8, 4))
        for w in range(4):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for n in range(n_cols // 8):
                    for x in range(4):
                        f[w, lane, n, x] = mat[16 * w + g + 8 * (x >> 1), 8 * n + 2 * t + (x & 1)]
        return f

    st = to_frag(ss(bmq, lambda kk: desc_kmajor(BN, sK, kk), lambda kk: desc_kmajor(bmq, qt, kk)), bmq)
    dpt = to_frag(ss(bmq, lambda kk: desc_kmajor(BN, sV, kk), lambda kk: desc_kmajor(bmq, dot, kk)), bmq)
    ref_st, ref_dpt = Kt @ Qt.T, Vt @ dOt.T
    assert np.allclose(st, to_frag(ref_st, bmq)) and np.allclose(dpt, to_frag(ref_dpt, bmq))

    def rs(frag, tile):  # dV / dK += A B: A from the kernel's packing of frag, B MN-major
        acc = np.zeros((64, d))
        for kq in range(bmq // 16):
            a = np.empty((64, 16))  # the A operand the hardware sees, rebuilt from each lane's registers
            for w in range(4):
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    # pa[kq][0..3] exactly as the kernel packs them: (lo, hi) halves
                    regs = [
                        (frag[w, lane, 2 * kq, 0], frag[w, lane, 2 * kq, 1]),
                        (frag[w, lane, 2 * kq, 2], frag[w, lane, 2 * kq, 3]),
                        (frag[w, lane, 2 * kq + 1, 0], frag[w, lane, 2 * kq + 1, 1]),
                        (frag[w, lane, 2 * kq + 1, 2], frag[w, lane, 2 * kq + 1, 3]),
                    ]
                    # RS A fragment: a0 (g, 2t..) a1 (g+8, 2t..) a2 (g, 2t+8..) a3 (g+8, 2t+8..)
                    for j, (lo, hi) in enumerate(regs):
                        r = 16 * w + g + 8 * (j & 1)
                        c = 2 * t + 8 * (j >> 1)
                        a[r, c], a[r, c + 1] = lo, hi
            acc += a @ hw_mnmajor(smem, desc_mnmajor(bmq, tile, kq), d)
        return acc

    dv, dk = rs(st, dot), rs(dpt, qt)
    assert np.allclose(dv, ref_st @ dOt), "dV path"
    assert np.allclose(dk, ref_dpt @ Qt), "dK path"


def dq_smem_config(d):  # DqWgmmaConfig (BM = BN = 64, 4 warps)
    qtile = ktile = 64 * d * 2
    tiles = 2 * qtile + 4 * ktile
    return dict(
        qtile=qtile, ktile=ktile, tiles=tiles, smem=1024 + tiles + (7 * 64 + 8 * 4) * 4, chain=lambda k: 64 * k * 8
    )


def rs_from_frag(smem, frag, desc_fn, n_k16, n_cols):
    """sum over k-steps of A B: A rebuilt from the kernel's packing of the accumulator-layout frag,
    B read MN-major through desc_fn(kstep)"""
    acc = np.zeros((64, n_cols))
    for kq in range(n_k16):
        a = np.empty((64, 16))
        for w in range(4):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                regs = [
                    (frag[w, lane, 2 * kq, 0], frag[w, lane, 2 * kq, 1]),
                    (frag[w, lane, 2 * kq, 2], frag[w, lane, 2 * kq, 3]),
                    (frag[w, lane, 2 * kq + 1, 0], frag[w, lane, 2 * kq + 1, 1]),
                    (frag[w, lane, 2 * kq + 1, 2], frag[w, lane, 2 * kq + 1, 3]),
                ]
                for j, (lo, hi) in enumerate(regs):
                    r = 16 * w + g + 8 * (j & 1)
                    c = 2 * t + 8 * (j >> 1)
                    a[r, c], a[r, c + 1] = lo, hi
        acc += a @ hw_mnmajor(smem, desc_fn(kq), n_cols)
    return acc


def check_dq_config(d, rng):
    cfg = dq_smem_config(d)
    assert cfg["smem"] + cfg["chain"](KMAXCHAIN) <= 227 * 1024
    # two CTAs per SM (228 KiB, 1 KiB reserved per CTA) at a typical K = 8
    assert 2 * (cfg["smem"] + cfg["chain"](8) + 1024) <= 228 * 1024
    for raw in range(0, 4096, 16):
        base = (raw + 1023) & ~1023
        assert base - raw + cfg["tiles"] + (7 * 64 + 8 * 4) * 4 <= cfg["smem"]
    for off in (
        0,
        cfg["qtile"],
        2 * cfg["qtile"],
        2 * cfg["qtile"] + cfg["ktile"],
        2 * cfg["qtile"] + 2 * cfg["ktile"],
        2 * cfg["qtile"] + 3 * cfg["ktile"],
    ):
        assert off % 1024 == 0
    base = 0x2400
    sQ, sdO = base, base + cfg["qtile"]
    sK, sV = base + 2 * cfg["qtile"], base + 2 * cfg["qtile"] + 2 * cfg["ktile"]
    stage = 1
    kt, vt = sK + stage * cfg["ktile"], sV + stage * cfg["ktile"]
    smem = Smem(base + cfg["tiles"] + 4096)
    n_q, n_keys = 90, 150
    Q, dO = rng.standard_normal((n_q, d)), rng.standard_normal((n_q, d))
    K, V = rng.standard_normal((n_keys, d)), rng.standard_normal((n_keys, d))
    row0, rows, j0, jend = 40, 37, 100, 141  # a partial query tile and a partial key block
    load_tile_sw128(smem, sQ, Q, 64, d, row0, row0 + rows)
    load_tile_sw128(smem, sdO, dO, 64, d, row0, row0 + rows)
    load_tile_sw128(smem, kt, K, 64, d, j0, jend)
    load_tile_sw128(smem, vt, V, 64, d, j0, jend)

    def rows_of(mat, first, limit):
        out = np.zeros((64, d))
        for r in range(64):
            if 0 <= first + r < limit:
                out[r] = mat[first + r]
        return out

    Qt, dOt = rows_of(Q, row0, row0 + rows), rows_of(dO, row0, row0 + rows)
    Kt, Vt = rows_of(K, j0, jend), rows_of(V, j0, jend)
    for kk in range(d // 16):
        for tile, ref in ((sQ, Qt), (sdO, dOt), (kt, Kt), (vt, Vt)):
            got = hw_kmajor(smem, desc_kmajor(64, tile, kk), 64)
            assert np.array_equal(got, ref[:, 16 * kk : 16 * kk + 16]), f"dQ K-major read kk={kk}"
    for kk in range(64 // 16):
        desc = desc_mnmajor(64, kt, kk)
        assert decode(desc) == (kt + 2048 * kk, 64 * 128, 1024)
        got = hw_mnmajor(smem, desc, d)
        assert np.array_equal(got, Kt[16 * kk : 16 * kk + 16, :]), f"dQ MN-major K read kk={kk}"

    def ss(ta, tb):
        return sum(
            hw_kmajor(smem, desc_kmajor(64, ta, kk), 64) @ hw_kmajor(smem, desc_kmajor(64, tb, kk), 64).T
            for kk in range(d // 16)
        )

    def to_frag(mat):
        f = np.empty((4, 32, 8, 4))
        for w in range(4):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for n in range(8):
                    for x in range(4):
                        f[w, lane, n, x] = mat[16 * w + g + 8 * (x >> 1), 8 * n + 2 * t + (x & 1)]
        return f

    S, dP = ss(sQ, kt), ss(sdO, vt)
    assert np.allclose(S, Qt @ Kt.T) and np.allclose(dP, dOt @ Vt.T)
    dS = S * (dP - 0.25)  # any elementwise map of the fragments: here a stand-in for P (dP - delta)
    dq = rs_from_frag(smem, to_frag(dS), lambda kk: desc_mnmajor(64, kt, kk), 4, d)
    assert np.allclose(dq, dS @ Kt), "dQ path"


def main():
    rng = np.random.default_rng(0)
    check_swizzle()
    for d, bmq in ((128, 64), (64, 64)):
        check_config(d, bmq, rng)
        print(f"D={d} BMQ={bmq}: smem {smem_config(d, bmq)['smem']} bytes, layout/descriptor/fragment maps consistent")
    for d in (128, 64):
        check_dq_config(d, rng)
        cfg = dq_smem_config(d)
        print(f"dQ D={d}: smem {cfg['smem']} + {cfg['chain'](1)} K bytes, layout/descriptor/fragment maps consistent")
    print("ok")


if __name__ == "__main__":
    main()

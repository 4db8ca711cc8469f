"""CPU emulation of the register/shared-memory index maps of the atomic dQ path of
csrc/attention/cuda/cod_attn_bwd.cuh (cod_attn_dkv_kernel<..., DQ_ATOMIC=true>), lane by lane.

Models (PTX ISA): mma.m16n8k16 fragments (g = lane / 4, t = lane % 4)
  A: a0 (g, 2t..2t+1) a1 (g+8, 2t..) a2 (g, 2t+8..) a3 (g+8, 2t+8..)   B: b0 (k 2t.., n g) b1 (k 2t+8.., n g)
  C: c0, c1 (g, 2t..2t+1) c2, c3 (g+8, 2t..)
ldmatrix.x4: lanes 8j..8j+7 address the 8 rows of matrix j; lane l receives (row l/4, cols 2(l%4), +1)
of matrix l >> 3 as its register j, with .trans (row 2(l%4) and 2(l%4)+1, col l/4).

Checks, for BMQ in (32 at D=128, 64 at D=64), every warp:
 1. the model against the kernel's existing (GPU-tested) dK += dS^T Q path: sa packing + frag_b_kn;
 2. the new path: dS^T stores into the swizzled tile, frag_a_ds (ldmatrix.trans), frag_b_kn on K,
    the lane-pair shuffle and the float4 atomic targets == dS K exactly (integer-valued data);
 3. bank conflicts of the dS^T stores and ldmatrix phases (none expected);
 4. every dq_accum element of the block is written exactly once per CTA iteration.
Run: python tools/kernels/emulate_attn_bwd_fragments.py  (prints 'ok' or raises)."""

import numpy as np

BN = 64


def swz(d, row, chunk):  # byte offset, cod_attn_utils.cuh swz<D>
    return (row * d + ((chunk ^ (row & 7)) << 3)) * 2


def ds_swz(bmq, key, qchunk):  # cod_attn_bwd.cuh ds_swz<BMQ>
    c = (qchunk ^ (key & 7)) if bmq == 64 else (qchunk ^ ((key >> 1) & 3))
    return (key * bmq + c * 8) * 2


class Smem:
    def __init__(self, nbytes):
        self.h = np.full(nbytes // 2, np.nan)  # 16-bit slots, values as float

    def ldmatrix_x4(self, addrs, trans):
        """addrs[lane] = byte address of row (lane & 7) of matrix lane >> 3 -> regs[lane][j] = 2 values"""
        regs = [[None] * 4 for _ in range(32)]
        for j in range(4):
            rows = [[self.h[addrs[8 * j + r] // 2 + c] for c in range(8)] for r in range(8)]
            assert all(addrs[8 * j + r] % 16 == 0 for r in range(8))
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                if trans:
                    regs[lane][j] = (rows[2 * t][g], rows[2 * t + 1][g])
                else:
                    regs[lane][j] = (rows[g][2 * t], rows[g][2 * t + 1])
        return regs

    def store_tile(self, d, mat):  # swizzled [rows][d] tile at byte 0 (load_tile)
        for r in range(mat.shape[0]):
            for c in range(d // 8):
                o = swz(d, r, c) // 2
                self.h[o : o + 8] = mat[r, 8 * c : 8 * c + 8]


def mma(c, a, b0, b1):
    """c[lane] (4 floats) += A B for per-lane fragments a[lane] (4 pairs), b0/b1[lane] (pairs)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        A[g, 2 * t : 2 * t + 2] = a[lane][0]
        A[g + 8, 2 * t : 2 * t + 2] = a[lane][1]
        A[g, 2 * t + 8 : 2 * t + 10] = a[lane][2]
        A[g + 8, 2 * t + 8 : 2 * t + 10] = a[lane][3]
        B[2 * t : 2 * t + 2, g] = b0[lane]
        B[2 * t + 8 : 2 * t + 10, g] = b1[lane]
    C = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] += np.array([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]])


def frag_b_kn(sm, d, tile, n0, kk):
    addrs = [tile + swz(d, 16 * kk + (l & 7) + ((l >> 3) & 1) * 8, (n0 >> 3) + (l >> 4)) for l in range(32)]
    return sm.ldmatrix_x4(addrs, trans=True)


def frag_a_ds(sm, bmq, tile, m0, kk):
    addrs = [tile + ds_swz(bmq, 16 * kk + (l & 7) + ((l >> 4) << 3), (m0 >> 3) + ((l >> 3) & 1)) for l in range(32)]
    return sm.ldmatrix_x4(addrs, trans=True), addrs


def bank_conflict_free_ldsm(addrs):
    for j in range(4):
        groups = {(addrs[8 * j + r] // 16) % 8 for r in range(8)}
        if len(groups) != 8:
            return False
    return True


def run(d, bmq, rng):
    dw, mt_n = d // 4, bmq // 16
    K = rng.integers(-3, 4, size=(BN, d)).astype(float)  # the CTA's 64 keys
    Q = rng.integers(-3, 4, size=(bmq, d)).astype(float)  # one query block
    dST = rng.integers(-3, 4, size=(BN, bmq)).astype(float)  # dS^T [key][query]
    tile_k, tile_q, tile_ds = 0, BN * d * 2, BN * d * 2 + bmq * d * 2
    sm = Smem(tile_ds + BN * bmq * 2)
    sm.store_tile(d, K)
    sm.h[tile_q // 2 : tile_q // 2 + bmq * d] = np.nan
    qs = Smem(bmq * d * 2)
    qs.store_tile(d, Q)
    sm.h[tile_q // 2 : tile_q // 2 + bmq * d] = qs.h
    store_banks = []
    for warp in range(4):
        # dpt[n][x] per lane: dS^T(key 16 warp + g + 8 (x >> 1), query 8 n + 2t + (x & 1))
        dpt = [
            [
                [dST[16 * warp + (l >> 2) + 8 * (x >> 1), 8 * n + 2 * (l & 3) + (x & 1)] for x in range(4)]
                for n in range(bmq // 8)
            ]
            for l in range(32)
        ]
        dk_all = [[np.zeros(4) for _ in range(32)] for _ in range(d // 8)]
        for kq in range(bmq // 16):
            sa = [
                [
                    (dpt[l][2 * kq][0], dpt[l][2 * kq][1]),
                    (dpt[l][2 * kq][2], dpt[l][2 * kq][3]),
                    (dpt[l][2 * kq + 1][0], dpt[l][2 * kq + 1][1]),
                    (dpt[l][2 * kq + 1][2], dpt[l][2 * kq + 1][3]),
                ]
                for l in range(32)
            ]
            # 2. the dS^T stores (one warp-wide 32-bit store per register)
            for x, (dk_row, dchunk) in enumerate([(0, 0), (8, 0), (0, 1), (8, 1)]):
                banks = []
                for l in range(32):
                    key = 16 * warp + (l >> 2) + dk_row
                    addr = tile_ds + ds_swz(bmq, key, 2 * kq + dchunk) + 4 * (l & 3)
                    sm.h[addr // 2], sm.h[addr // 2 + 1] = sa[l][x]
                    banks.append((addr // 4) % 32)
                store_banks.append(len(set(banks)) == 32)
            # 1. existing dK path: dk[2dp (+1)] += sa x frag_b_kn(Q)
            for dp in range(d // 16):
                bf = frag_b_kn(sm, d, tile_q, 16 * dp, kq)
                mma(dk_all[2 * dp], sa, [r[0] for r in bf], [r[1] for r in bf])
                mma(dk_all[2 * dp + 1], sa, [r[2] for r in bf], [r[3] for r in bf])
        want_dk = dST[16 * warp : 16 * warp + 16] @ Q  # [16 keys][d]
        for n in range(d // 8):
            for l in range(32):
                g, t = l >> 2, l & 3
                got = dk_all[n][l]
                exp = [
                    want_dk[g, 8 * n + 2 * t],
                    want_dk[g, 8 * n + 2 * t + 1],
                    want_dk[g + 8, 8 * n + 2 * t],
                    want_dk[g + 8, 8 * n + 2 * t + 1],
                ]
                assert np.array_equal(got, exp), ("model mismatch on the existing dK path", d, bmq, warp)
    assert all(store_banks), "dS^T stores have bank conflicts"
    assert not np.isnan(sm.h[tile_ds // 2 :]).any(), "dS^T tile not fully written"
    # the dQ phase, every warp (after the barrier)
    want = dST.T @ K  # dQ [bmq][d]
    written = np.zeros((bmq, d), dtype=int)
    got = np.zeros((bmq, d))
    for warp in range(4):
        dqa = [[[np.zeros(4) for _ in range(32)] for _ in range(dw // 8)] for _ in range(mt_n)]
        for kk in range(BN // 16):
            a = []
            for mt in range(mt_n):
                regs, addrs = frag_a_ds(sm, bmq, tile_ds, 16 * mt, kk)
                assert bank_conflict_free_ldsm(addrs), "dS^T ldmatrix bank conflict"
                a.append(regs)
            for np_ in range(dw // 16):
                bf = frag_b_kn(sm, d, tile_k, warp * dw + 16 * np_, kk)
                for mt in range(mt_n):
                    mma(dqa[mt][2 * np_], a[mt], [r[0] for r in bf], [r[1] for r in bf])
                    mma(dqa[mt][2 * np_ + 1], a[mt], [r[2] for r in bf], [r[3] for r in bf])
        for mt in range(mt_n):
            for n in range(dw // 8):
                c = dqa[mt][n]
                send = [(c[l][0], c[l][1]) if (l & 3) & 1 else (c[l][2], c[l][3]) for l in range(32)]
                for l in range(32):
                    g, t = l >> 2, l & 3
                    odd = t & 1
                    r0, r1 = send[l ^ 1]
                    vals = (r0, r1, c[l][2], c[l][3]) if odd else (c[l][0], c[l][1], r0, r1)
                    row = 16 * mt + g + 8 * odd
                    col = warp * dw + 8 * n + 4 * (t >> 1)
                    assert col % 4 == 0
                    got[row, col : col + 4] += vals
                    written[row, col : col + 4] += 1
    assert (written == 1).all(), "dq_accum element written != once"
    assert np.array_equal(got, want), ("dQ mismatch", d, bmq, np.abs(got - want).max())


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    for d, bmq in ((128, 32), (64, 64), (128, 64), (64, 32)):
        run(d, bmq, rng)
        print(f"D={d} BMQ={bmq}: dK model check, dQ = dS K, bank-conflict-free stores/ldmatrix, one write each: ok")
    print("ok")

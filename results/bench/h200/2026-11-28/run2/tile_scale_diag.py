import torch, pp_compress as ppc
from pp_compress.ops import pivoted
for spec, dtype in [("tile:3.5", torch.bfloat16), ("tile:2.5:lo=2:hi=3:size=32:pivots=2", torch.float32),
                    ("tile:3.5:rot=false:pivots=0", torch.bfloat16), ("tile:3.5", torch.float32)]:
    x = (torch.randn(4, 128, 576, generator=torch.Generator().manual_seed(3)) * 3).to(device="cuda", dtype=dtype)
    x[..., 0, 5] = 400.0
    op, eager = ppc.build(spec), ppc.build(f"{spec}:kernel=eager")
    ctx = ppc.Context(step=5, micro_batch=2)
    c = op.config
    dm, n_hi = op._dims(tuple(x.shape), ctx.name)
    tf, pf = pivoted.split(x, dm, c.size, c.rot, ctx, "tile-rot", True)
    te, pe = pivoted.split(x, dm, c.size, c.rot, ctx, "tile-rot", False)
    print("==", spec, dtype, "split t equal", torch.equal(tf, te), "ndiff", int((tf != te).sum()),
          "pivots equal", [torch.equal(a, b) for a, b in zip(pf, pe)])
    if not torch.equal(tf, te):
        i = (tf != te).nonzero()[:5]
        print("  t diffs at", i.tolist(), tf[i[:, 0], i[:, 1]].tolist(), te[i[:, 0], i[:, 1]].tolist())
    want, got = eager.compress(x, ctx), op.compress(x, ctx)
    for j, (a, b) in enumerate(zip(got.tensors, want.tensors)):
        nd = int((a != b).sum()) if a.shape == b.shape else -1
        print(f"  payload[{j}] {a.dtype} {tuple(a.shape)} ndiff {nd}")
        if nd > 0:
            i = (a.reshape(-1) != b.reshape(-1)).nonzero()[:6].reshape(-1)
            print("    at", i.tolist(), "fused", a.reshape(-1)[i].tolist(), "eager", b.reshape(-1)[i].tolist())
    # the int parts alone on the same tiles
    spread = 2 * te.abs().amax(dim=1)
    ranked = torch.argsort(spread, descending=True, stable=True)
    high = torch.zeros(dm.tiles, dtype=torch.bool, device=x.device).index_fill_(0, ranked[:n_hi], True)
    order = torch.argsort(~high, stable=True)
    for part_f, part_e, rows in zip(op.parts, eager.parts, (order[:n_hi], order[n_hi:])):
        a, b = part_f.encode_rows(te, rows, ctx), part_e.encode_rows(te, rows, ctx)
        print("  part", part_f.spec, [int((u != v).sum()) for u, v in zip(a.tensors, b.tensors)])
        s_f, s_e = a.tensors[1].float(), b.tensors[1].float()
        if not torch.equal(s_f, s_e):
            i = (s_f != s_e).nonzero()[:4].reshape(-1)
            g = te[rows[i]]
            print("    scale diffs", i.tolist(), s_f[i].tolist(), s_e[i].tolist(), "amax", g.abs().amax(1).tolist())
        a2 = part_f.encode(te[rows], ctx)
        print("    fused on gathered copy vs eager", [int((u != v).sum()) for u, v in zip(a2.tensors, b.tensors)])

"""The engine's KV slabs (asyncrl/engines/torch/kv_batch.py) hold exactly what Hugging Face's
concatenating cache would, through appends, growth, left trims, row selection and
merges, and the CPU decode matmuls (asyncrl/engines/torch/cpu_linear.py) equal ``F.linear``."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

from asyncrl.engines.torch import cpu_linear as cpu_linear
from asyncrl.engines.torch.kv_batch import KVBatch, SlabLayer, cache_of_rows, swap_removed


def kv(b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 2, t, 4), torch.randn(b, 2, t, 4)


def test_a_slab_holds_what_concatenation_would_through_growth_trims_and_selection():
    torch.manual_seed(0)
    layer, keys, values = SlabLayer(), None, None
    for t in (5, 1, 1, 70, 1, 200, 1):  # prefill, decode steps, and appends past capacity
        k, v = kv(3, t)
        got_k, got_v = layer.update(k, v)
        keys = k if keys is None else torch.cat([keys, k], dim=2)
        values = v if values is None else torch.cat([values, v], dim=2)
        assert torch.equal(got_k, keys) and torch.equal(got_v, values)
        assert layer.get_seq_length() == keys.shape[2]
    layer.trim_left(7)
    keys, values = keys[:, :, 7:], values[:, :, 7:]
    assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    layer.batch_select_indices(torch.tensor([2, 0]))
    keys, values = keys[[2, 0]], values[[2, 0]]
    assert torch.equal(layer.keys, keys) and layer.get_seq_length() == keys.shape[2]
    k, v = kv(2, 1)  # the selected rows go on growing
    got_k, _ = layer.update(k, v)
    assert torch.equal(got_k, torch.cat([keys, k], dim=2))


def test_joining_rows_are_left_padded_with_zeros_in_free_rows_or_a_new_slab():
    torch.manual_seed(1)
    a, b = SlabLayer(), SlabLayer()
    ka, va = kv(2, 6)
    kb, vb = kv(1, 9)
    a.update(ka, va)
    b.update(kb, vb)
    slab = a._k
    a.append_rows(b, 9)  # no free rows: a new slab
    assert a._k is not slab and a.keys.shape == (3, 2, 9, 4)
    assert torch.equal(a.keys[:2, :, 3:], ka) and torch.equal(a.values[2:], vb)
    assert not a.keys[:2, :, :3].any()  # zeros: masked scores must stay finite
    k, v = kv(3, 1)
    assert torch.equal(a.update(k, v)[0][:, :, -1:], k)
    slab = a._k
    a.keep_rows(2)  # a row leaves: the slab keeps it free
    a._k[2:].fill_(float("nan"))  # whatever a freed row held
    kc, vc = kv(1, 4)
    c = SlabLayer()
    c.update(kc, vc)
    a.append_rows(c, 10)
    assert a._k is slab and a.keys.shape == (3, 2, 10, 4)  # in place
    assert torch.equal(a.keys[2:, :, 6:], kc) and not a.keys[2:, :, :6].any()
    assert torch.equal(a.keys[0, :, 3:], torch.cat([ka[0], k[0]], dim=1))  # moved nowhere
    assert not a.keys[0, :, :3].any()
    assert not a.keys.isnan().any()


def test_a_wider_join_zeroes_the_columns_it_opens_in_rows_that_joined_in_place():
    """Rows of 2, 20, 2 and 2 positions; two leave (their slab rows then hold NaN); a
    row of 5 joins in place, then one of 10, which opens columns left of all three."""
    torch.manual_seed(6)
    batch: KVBatch[int] = KVBatch()
    parts = [SimpleNamespace(keys=[k], values=[k.clone()], length=k.shape[1])
             for k in (torch.randn(2, n, 4) for n in (2, 20, 2, 2))]  # fmt: skip
    batch.add([0, 1, 2, 3], *cache_of_rows(parts), [0] * 4)
    batch.select([0, 3], torch.device("cpu"))  # two live rows of 2: two rows free
    layer = batch.cache.layers[0]
    assert layer._k.shape[0] == 4 and layer.keys.shape == (2, 2, 2, 4)
    layer._k[2:].fill_(float("nan"))
    layer._v[2:].fill_(float("nan"))
    for n, row in ((5, 4), (10, 5)):
        k = torch.randn(2, n, 4)
        part = SimpleNamespace(keys=[k], values=[k.clone()], length=n)
        batch.add([row], *cache_of_rows([part]), [0])
    assert batch.cache.layers[0] is layer and layer.keys.shape == (4, 2, 10, 4)
    assert batch.seqs == [0, 3, 4, 5]
    assert not layer.keys.isnan().any() and not layer.values.isnan().any()
    assert not layer.keys[:2, :, :8].any() and not layer.keys[2, :, :5].any()


def test_a_slab_left_mostly_free_moves_into_one_of_its_live_rows():
    layer = SlabLayer()
    k, v = kv(8, 5)
    layer.update(k, v)
    layer.keep_rows(4)  # half free: kept
    assert layer._k.shape[0] == 8
    layer.keep_rows(3)  # more than half: moved
    assert layer._k.shape[0] == 3 and torch.equal(layer.keys, k[:3])
    assert torch.equal(layer.values, v[:3])


def test_swap_removal_moves_the_last_kept_rows_into_the_holes():
    assert swap_removed(5, [0, 2, 4]) == [0, 4, 2]
    assert swap_removed(4, [0, 1]) == [0, 1]  # the leavers were last: nothing moves
    assert swap_removed(4, [3]) == [3]
    assert swap_removed(3, [0, 1, 2]) == [0, 1, 2]


def test_a_batch_holds_each_rows_kv_through_joins_steps_and_departures():
    """Random joins, decode steps and departures: each row's cache is its own positions at
    the right end, zeros on their left, and its mask and position say so."""
    torch.manual_seed(5)
    gen = torch.Generator().manual_seed(5)
    batch: KVBatch[int] = KVBatch()
    truth: dict[int, torch.Tensor] = {}  # row id -> its keys [heads, length, d] (1 layer)
    ids, nonempty = iter(range(10_000)), 0

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    for step in range(300):
        if len(batch) < 12 and (step % 3 == 0 or not len(batch)):
            lengths = torch.randint(1, 30, (int(torch.randint(1, 5, (1,))),), generator=gen)
            made = [rand(2, int(n), 4) for n in lengths]  # values: a copy of the keys
            parts = [SimpleNamespace(keys=[x], values=[x.clone()], length=x.shape[1]) for x in made]
            cache, mask = cache_of_rows(parts)
            new = [next(ids) for _ in parts]
            truth |= {r: p.keys[0] for r, p in zip(new, parts, strict=True)}
            batch.add(new, cache, mask, [0] * len(new))
        k = rand(len(batch), 2, 1, 4)
        batch.cache.layers[0].update(k, k.clone())
        batch.mask = torch.cat([batch.mask, torch.ones(len(batch), 1, dtype=torch.long)], 1)
        batch.positions = batch.positions + 1
        for i, r in enumerate(batch.seqs):
            truth[r] = torch.cat([truth[r], k[i]], dim=1)
        leave = torch.rand(len(batch), generator=gen) < 0.15
        batch.select([i for i in range(len(batch)) if not leave[i]], torch.device("cpu"))
        if not len(batch):
            continue
        layer = batch.cache.layers[0]
        assert layer.keys.shape[:2] == (len(batch), 2) == (len(batch.seqs), 2)
        assert layer.keys.shape[2] == batch.mask.shape[1] and batch.mask[:, 0].any()
        for i, r in enumerate(batch.seqs):
            n = truth[r].shape[1]
            assert int(batch.mask[i].sum()) == n == int(batch.positions[i])
            assert torch.equal(layer.keys[i, :, -n:], truth[r])
            assert torch.equal(layer.values[i, :, -n:], truth[r])
            assert not layer.keys[i, :, :-n].any()
        nonempty += 1
    assert nonempty > 200  # the batch was non-empty on most steps


@pytest.mark.parametrize("packed", [True, False])
def test_cpu_decode_linears_equal_f_linear_and_leave_the_module_as_it_was(packed: bool):
    torch.manual_seed(2)
    # Weights past MIN_ELEMENTS (smaller ones go to F.linear).
    model = torch.nn.Sequential(torch.nn.Linear(256, 320), torch.nn.Linear(320, 256, bias=False))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = [torch.randn(1, 256), torch.randn(3, 5, 256), torch.randn(300, 256)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    assert cpu_linear.use_for(model, packed=packed) == 2
    with torch.inference_mode():
        for x, want in zip(inputs, expected, strict=True):
            got = model(x)
            assert got.shape == want.shape and got.is_contiguous()
            assert torch.allclose(got, want, atol=1e-4)
    assert (model[0]._packed is not None) == (packed and cpu_linear.packable(torch.float32))
    loss = model(torch.randn(4, 256)).sum()  # with gradients: F.linear, which trains
    loss.backward()
    assert model[0].weight.grad is not None
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    copy = pickle.loads(pickle.dumps(model))  # a changed model still pickles
    with torch.inference_mode():
        assert torch.allclose(copy(inputs[0]), expected[0], atol=1e-4)


@pytest.mark.skipif(not cpu_linear.packable(torch.bfloat16), reason="no oneDNN bf16 here")
def test_packed_bf16_linears_equal_f_linear():
    torch.manual_seed(3)
    layer = torch.nn.Linear(256, 384).to(torch.bfloat16)
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    cpu_linear.use_for(layer)
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.bfloat16 and layer._packed is not None
    assert torch.allclose(got.double(), want, atol=2e-2, rtol=2e-2)


def test_a_packed_weight_follows_writes_through_torch_and_invalidate_for_the_rest():
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(256, 320))
    cpu_linear.use_for(model)
    x = torch.randn(5, 256)

    def out() -> torch.Tensor:
        with torch.inference_mode():
            return model(x)

    def want() -> torch.Tensor:
        with torch.no_grad():
            return torch.nn.functional.linear(x, model[0].weight, model[0].bias)

    out()
    assert model[0]._packed is not None or not cpu_linear.packable(torch.float32)
    with torch.no_grad():
        model[0].weight.mul_(-2.0)  # in place through torch: its version counter moves
    assert torch.allclose(out(), want(), atol=1e-4)
    model[0].weight.detach().numpy()[:] = torch.randn(320, 256).numpy()  # around the counter
    cpu_linear.invalidate(model)  # what a transport writing memory directly must do
    assert torch.allclose(out(), want(), atol=1e-4)
    model[0].weight = torch.nn.Parameter(torch.randn(320, 256))  # replaced: a new storage
    assert torch.allclose(out(), want(), atol=1e-4)

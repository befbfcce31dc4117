"""Two ranks' values have one fingerprint exactly when they are equal: the same class defined in a
cell on each rank, equal tensors at other addresses and the prepared model's references agree;
another tensor, generator state or number does not."""

from __future__ import annotations

import torch

from jupyter_shard.rank.fingerprint import fingerprints


def _define() -> type:
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec("class Net:\n    def __init__(self):\n        self.w = 3\n", namespace)
    return namespace["Net"]  # type: ignore[return-value]


def test_equal_values_agree_across_separately_built_copies() -> None:
    one, two = _define(), _define()
    assert one is not two
    model_a, model_b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    a = {"Net": one, "n": one(), "t": torch.arange(6.0).reshape(2, 3), "head": model_a, "xs": [1, "a"]}
    b = {"Net": two, "n": two(), "t": torch.arange(6.0).reshape(2, 3), "head": model_b, "xs": [1, "a"]}
    fa = fingerprints(a, {id(model_a): "model"})
    fb = fingerprints(b, {id(model_b): "model"})
    assert fa == fb and set(fa) == set(a)


def test_different_values_differ() -> None:
    a = {
        "t": torch.zeros(3),
        "g": torch.Generator().manual_seed(0),
        "x": 1,
        "bf": torch.zeros(2, dtype=torch.bfloat16),
    }
    b = {
        "t": torch.ones(3),
        "g": torch.Generator().manual_seed(1),
        "x": 2,
        "bf": torch.ones(2, dtype=torch.bfloat16),
    }
    fa, fb = fingerprints(a, {}), fingerprints(b, {})
    assert all(fa[name] != fb[name] for name in a)


def test_a_value_that_cannot_be_pickled_has_none() -> None:
    assert fingerprints({"gen": (i for i in range(3)), "ok": 1}, {}).keys() == {"ok"}


def test_a_cell_function_counts_as_its_code_not_the_names_it_reads() -> None:
    """``train`` reads ``data``, which differs by rank: ``data`` is listed, ``train`` is not."""
    prints = []
    for rank in (0, 1):
        ns: dict[str, object] = {"__name__": "__main__", "rank": rank}
        exec("data = [rank] * 3\ndef train(k=2):\n    return sum(data) * k\n", ns)
        prints.append(fingerprints({"train": ns["train"], "data": ns["data"]}, {}, ns))
    assert prints[0]["train"] == prints[1]["train"]
    assert prints[0]["data"] != prints[1]["data"]


def test_objects_remade_for_each_rank_count_as_their_type() -> None:
    class Loader:
        def __init__(self, rank: int) -> None:
            self.rank = rank

    a = fingerprints({"loader": Loader(0)}, {}, None, (Loader,))
    b = fingerprints({"loader": Loader(1)}, {}, None, (Loader,))
    assert a == b

"""Two engine replicas behind the prefix-affinity router.

Requests sharing a long system prompt must land on the replica that already holds its
blocks (prefix-cache hits counted per replica), while unrelated prompts spread.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from pagedserve.worker.loaders import resolve_model
from pagedserve.worker.testing import write_random_lora
from tests.serving.conftest import App, Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = ("You are the support assistant of a bicycle shop. Answer politely, briefly, and "
          "only about bicycles, their parts, repairs and prices. ") * 4


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("routing_loras")
    write_random_lora(resolve_model(None).path, root / "bikes", ["q_proj", "v_proj"], r=4)
    return str(root)


@pytest.fixture(scope="module")
def pair(cluster: Cluster, lora_dir: str) -> Iterator[App]:
    app = cluster.deploy("pair", {"num_replicas": 2, "num_gpu_blocks": 128,
                                  "max_model_len": 1024, "num_threads": 1,
                                  "lora_dir": lora_dir})
    yield app
    cluster.delete("pair")


def _delta(before: dict, after: dict, key: str) -> dict[str, int]:
    return {r: after[r][key] - before[r][key] for r in after}


def test_shared_system_prompt_sticks_to_one_replica(pair: App) -> None:
    client = pair.openai()
    before = pair.stats()
    assert len(before) == 2
    cached = []
    for i in range(6):
        r = client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=4,
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": f"Question {i}: how much is a tyre?"}])
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    after = pair.wait_baseline()
    finished = _delta(before, after, "finished_requests")
    hits = _delta(before, after, "prefix_cache_hits")
    home = max(finished, key=lambda r: finished[r])
    other = next(r for r in finished if r != home)
    assert finished[home] == 6 and finished[other] == 0, finished
    # Every request after the first reused the system prompt's blocks on that replica.
    assert cached[0] == 0 and all(c >= 96 for c in cached[1:]), cached
    assert hits[home] >= sum(cached) and hits[other] == 0, hits


def test_distinct_prompts_spread(pair: App) -> None:
    client = pair.openai()
    before = pair.stats()
    rng = random.Random(0)
    for _ in range(6):
        words = " ".join(rng.choice(["red", "blue", "seven", "lamp", "river", "cloud"])
                         for _ in range(40))
        client.completions.create(model=MODEL, prompt=words, max_tokens=2)
    after = pair.wait_baseline()
    finished = _delta(before, after, "finished_requests")
    assert sorted(finished.values()) == [3, 3], finished


def test_affinity_follows_the_prefix_not_the_request_order(pair: App) -> None:
    """Two prefixes, interleaved: each keeps going to the replica that holds it."""
    client = pair.openai()
    prefixes = ["Alpha protocol. " * 40, "Omega manual. " * 40]
    homes: dict[int, set[str]] = {0: set(), 1: set()}
    for i in range(6):
        k = i % 2
        before = pair.stats()
        client.completions.create(model=MODEL, prompt=prefixes[k] + f" Item {i}:",
                                  max_tokens=2)
        after = pair.wait_baseline()
        finished = _delta(before, after, "finished_requests")
        homes[k].update(r for r, n in finished.items() if n)
    assert len(homes[0]) == 1 and len(homes[1]) == 1, homes


def test_an_adapters_requests_go_to_the_replica_that_loaded_it(pair: App) -> None:
    """Prompts shorter than a block carry no prefix, yet an adapter's requests stick to
    one replica (its affinity key), so the other never loads the adapter."""
    client = pair.openai()
    before = pair.stats()
    rng = random.Random(1)
    for _ in range(6):
        words = " ".join(rng.choice(["gear", "chain", "tyre", "bell"]) for _ in range(3))
        client.completions.create(model="bikes", prompt=words, max_tokens=2)
    after = pair.wait_baseline()
    finished = _delta(before, after, "finished_requests")
    assert sorted(finished.values()) == [0, 6], finished
    loaded = {r: s["lora"]["loaded"] for r, s in after.items()}
    assert sorted(loaded.values()) == [[], ["bikes"]], loaded

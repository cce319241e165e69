"""Plans sent to Ray ranks as changes (``scheduler/plan_wire.py``) decode to the plans
the scheduler made, through preemption, forks, prefix hits, drafts, offloading and
aborts; a rank out of step fails loudly; a reset or a replaced rank starts whole."""

from __future__ import annotations

import pickle
import random

import pytest

from pagedserve.scheduler.outputs import ScheduledRequest, SchedulerOutput
from pagedserve.scheduler.plan_wire import _SLACK, _TABLE, PlanDecoder, PlanEncoder
from pagedserve.scheduler.sampling_params import SamplingParams
from tests.scheduler.helpers import SHARED_PREFIX, check_invariants, machine_scheduler


def _wire(enc: PlanEncoder, plan: SchedulerOutput) -> bytes:
    return pickle.dumps(enc.encode(plan), protocol=5)


def _run(seed: int, mode: str, spec: int | None, offload: bool, wire: bool,
         groups: tuple[int | None, ...] = ()
         ) -> tuple[dict[str, list[int]], list[int], list[int], int]:
    """A random workload on a small pool; with ``wire`` every plan goes through the
    encoder, pickling and two ranks' decoders before the KV simulator runs it. Returns
    the tokens, each step's encoded and whole pickled sizes, and the preemptions."""
    rng = random.Random(seed)
    sched, sim = machine_scheduler(gpu_blocks=20, cpu_blocks=8, mode=mode, budget=16,
                                   spec=spec, copy_period=3, offload=offload,
                                   window=groups or None)
    enc, ranks = PlanEncoder(), [PlanDecoder(), PlanDecoder()]
    out: dict[str, list[int]] = {}
    sizes, whole = [], []
    number = 0
    for step in range(400):
        if number < 24 and rng.random() < 0.35:
            _add(sched, rng, number)
            number += 1
        if step % 7 == 3 and sched.requests and rng.random() < 0.5:
            sched.abort(rng.choice(sorted(sched.requests)).split("#")[0])
        if not sched.has_unfinished_requests():
            if number >= 24:
                break
            continue
        plan = sched.schedule()
        if wire:
            blob = _wire(enc, plan)
            decoded = [r.decode(pickle.loads(blob)) for r in ranks]
            assert decoded[0] == plan and decoded[1] == plan, step
            sizes.append(len(blob))
            whole.append(len(pickle.dumps(plan, protocol=5)))
            plan_run = decoded[1]
        else:
            plan_run = plan
        for u in sched.update_from_output(plan, sim.execute(plan_run)):
            out.setdefault(u.request_id, []).extend(t.token_id for t in u.new_tokens)
        check_invariants(sched, sim)
    assert number == 24 and not sched.has_unfinished_requests()
    return out, sizes, whole, sum(sched.num_preemptions.values())


@pytest.mark.parametrize("mode,spec,offload,groups", [
    ("swap", None, False, ()), ("recompute", 3, False, ()), ("swap", 1, True, ()),
    ("recompute", None, True, ()), ("swap", 3, False, (None, 6, 6))])
def test_decoded_plans_are_the_scheduler_plans(mode: str, spec: int | None, offload: bool,
                                               groups: tuple[int | None, ...]) -> None:
    """Every decoded plan equals the one made (tables, a hybrid model's group tables,
    parameters, every field), on two ranks, and the run's tokens equal a run on whole
    plans; rows mostly travel small."""
    preempted = 0
    for seed in range(4):
        got, sizes, whole, n = _run(seed, mode, spec, offload, True, groups)
        want, _, _, _ = _run(seed, mode, spec, offload, False, groups)
        assert got == want
        assert sum(sizes) < 0.75 * sum(whole), (sum(sizes), sum(whole))
        preempted += n
    assert preempted > 0  # tables freed and rebuilt went through too


def _add(sched, rng: random.Random, number: int) -> None:
    """Request ``q<number>``: after the shared prefix or not, ``n`` up to 3, and every
    third with penalties (its rows carry the prompt and the output history)."""
    tail = [100 + ((number + 1) * 13 + j) % 80 for j in range(rng.randint(1, 20))]
    prompt = (SHARED_PREFIX + tail) if rng.random() < 0.5 else tail
    pen = {"repetition_penalty": 1.3, "presence_penalty": 0.5} if number % 3 == 0 else {}
    params = SamplingParams(n=rng.randint(1, 3), max_tokens=rng.randint(1, 10),
                            temperature=0.0, **pen)
    try:
        sched.add_request(sched.make_request(f"q{number}", prompt, params))
    except ValueError as e:
        assert "KV blocks" in str(e)


def _decode_row(table: list[int], rid: str = "r", sp: SamplingParams | None = None
                ) -> ScheduledRequest:
    sp = sp or SamplingParams()
    return ScheduledRequest(rid, [1], 4 * len(table) - 1, table, [rid], {rid: sp})


def test_a_long_context_decode_row_sends_only_its_new_blocks() -> None:
    """Step after step a decode row sends its table's tail and no parameters, and a row
    with penalties its newest output token and not its prompt: the encoded plan stays
    the same size while tables and histories grow."""
    enc, rank = PlanEncoder(), PlanDecoder()
    params = {f"r{i}": SamplingParams(temperature=0.5, repetition_penalty=1.1 if i % 2 else 1)
              for i in range(64)}
    prompts = [list(range(i, i + 2000)) for i in range(64)]
    sizes = []
    for step in range(1, 200):
        rows = [_decode_row(list(range(i * 1000, i * 1000 + step)), f"r{i}", params[f"r{i}"])
                for i in range(64)]
        for i, r in enumerate(rows):
            if i % 2:  # a fresh slice of the history each step, as the scheduler makes
                r.output_token_ids = {r.request_id: list(range(step))}
                r.prompt_token_ids = prompts[i]
        plan = SchedulerOutput(step, rows)
        blob = _wire(enc, plan)
        assert rank.decode(pickle.loads(blob)) == plan
        sizes.append(len(blob))
    assert max(sizes[1:]) < 1.1 * min(sizes[1:])
    assert sizes[-1] * 20 < len(pickle.dumps(plan, protocol=5))


def test_a_table_whose_front_is_released_sends_only_what_changed() -> None:
    """A sliding window's table turns its leading entries to -1 as it moves: the row
    sends how many, and its new blocks, not the table again; also when every entry
    the rank holds was released."""
    enc, rank = PlanEncoder(), PlanDecoder()
    table = list(range(100, 400))
    for step, released in enumerate((0, 0, 5, 40, 299, 305)):
        table = [-1] * released + table[released:] + [1000 + step]
        plan = SchedulerOutput(step, [_decode_row(list(table))])
        sent = enc.encode(plan)
        if step and released:
            k, tail, r = sent.rows[0][_TABLE]
            assert (k, r) == (len(table) - 1, released) and tail == [1000 + step]
        assert rank.decode(pickle.loads(pickle.dumps(sent))) == plan


def test_a_rank_that_missed_a_plan_fails_loudly() -> None:
    """A rank that did not decode the previous plan raises instead of attending to
    other blocks (a missed copy-on-write would leave the lengths equal); a reset plan
    brings it, or a replaced rank, back in step."""
    enc, behind = PlanEncoder(), PlanDecoder()
    sp = SamplingParams()
    behind.decode(pickle.loads(_wire(enc, SchedulerOutput(1, [_decode_row([3, 4], sp=sp)]))))
    _wire(enc, SchedulerOutput(2, [_decode_row([3, 8], sp=sp)]))  # never reaches it
    third = SchedulerOutput(3, [_decode_row([3, 8, 9], sp=sp)])
    with pytest.raises(RuntimeError, match="missed one"):
        behind.decode(pickle.loads(_wire(enc, third)))
    with pytest.raises(RuntimeError, match="missed one"):  # a fresh rank needs a reset
        PlanDecoder().decode(pickle.loads(_wire(enc, third)))
    # A block replaced under the same length (copy-on-write of the last one) is seen.
    enc2, rank2 = PlanEncoder(), PlanDecoder()
    rank2.decode(pickle.loads(_wire(enc2, SchedulerOutput(1, [_decode_row([3, 4], sp=sp)]))))
    cow = SchedulerOutput(2, [_decode_row([3, 8], sp=sp)])
    assert rank2.decode(pickle.loads(_wire(enc2, cow))) == cow
    enc.reset()
    fourth = SchedulerOutput(4, [_decode_row([3, 8, 9, 7], sp=sp)])
    blob = _wire(enc, fourth)
    assert behind.decode(pickle.loads(blob)) == fourth
    assert PlanDecoder().decode(pickle.loads(blob)) == fourth
    fifth = SchedulerOutput(5, [_decode_row([3, 8, 9, 7, 2], sp=sp)])
    assert behind.decode(pickle.loads(_wire(enc, fifth))) == fifth


def test_a_row_that_does_not_fit_the_records_fails_loudly() -> None:
    """Records that disagree with the driver's (which plan numbering should rule out)
    are caught on the row: a table the rank lacks, a length or last block that differs,
    parameters never sent."""
    sp = SamplingParams()
    for known, table, match in (([3], [3, 4, 5], "does not hold"),
                                ([3, 4], [3, 4, 5], "differs from the driver's"),
                                (None, [], "never sent")):
        enc, rank = PlanEncoder(), PlanDecoder()
        first = SchedulerOutput(1, [_decode_row([3, 4] if known else [], sp=sp)])
        rank.decode(pickle.loads(_wire(enc, first)))
        if known is not None:
            rank._rec.tables["r"] = list(known)
        else:
            rank._rec.params.clear()
        second = pickle.loads(_wire(enc, SchedulerOutput(2, [_decode_row(table, sp=sp)])))
        if match == "differs from the driver's":
            second.lengths[0] += 1
        with pytest.raises(RuntimeError, match=match):
            rank.decode(second)
        # Its records may be half updated: the next plan fails too, until a reset.
        third = SchedulerOutput(3, [_decode_row(table, sp=sp)])
        with pytest.raises(RuntimeError, match="missed one"):
            rank.decode(pickle.loads(_wire(enc, third)))
        enc.reset()
        assert rank.decode(pickle.loads(_wire(enc, third))) == third


def test_records_are_dropped_with_their_requests_and_bounded() -> None:
    """Finished and aborted requests leave both sides' records; records of requests no
    plan named as gone are cleared once they outgrow the running set."""
    enc, rank = PlanEncoder(), PlanDecoder()
    plan = SchedulerOutput(1, [_decode_row([1], f"a{i}") for i in range(10)])
    rank.decode(pickle.loads(_wire(enc, plan)))
    gone = SchedulerOutput(2, [_decode_row([1, 2], "a0")], finished_ids=["a1", "a2"],
                           aborted_ids=["a3"])
    assert rank.decode(pickle.loads(_wire(enc, gone))) == gone
    assert "a1" not in enc._rec.tables and "a3" not in rank._rec.tables
    assert "a4" in rank._rec.tables and "a3" not in rank._rec.params
    bound = 4 + _SLACK + 1
    for step in range(3, bound + 100):  # requests that vanish unannounced, one a step
        p = SchedulerOutput(step, [_decode_row([step], f"x{step}")])
        assert rank.decode(pickle.loads(_wire(enc, p))) == p
        assert len(enc._rec.tables) <= bound and len(rank._rec.tables) <= bound
    assert len(rank._rec.tables) < 200  # started over once past the bound

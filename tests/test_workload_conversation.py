"""Multi-turn conversations (workload kind conversation): pure turn specs, the session's history on the wire,
sessions as tickets held by one user, and the cache-hit ratio rising by turn in virtual and real time."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import LOADLAB, REPO

from loadlab.load import Tickets
from loadlab.profile import ProfileError, load_profile, validate_profile
from loadlab.records import MEASURE, WARMUP, load_records
from loadlab.sim.clock import output_ids_for
from loadlab.virtual import run_virtual, simulate
from loadlab.workload import TOKEN_ID_BASE, Dialogue, build_workload, get_renderer

CONV = {"kind": "conversation", "turns": 3, "system_prompt_len": 64, "user_len": 16, "output_len": 12}


def profile(workload=None, **extra):
    return validate_profile({"seed": 2, "workload": {**CONV, **(workload or {})}, **extra})


# ---------------------------------------------------------------- the specs


def test_a_turn_spec_is_pure_and_holds_only_what_the_turn_adds():
    w = build_workload(profile({"user_len_range": [4, 9], "output_len_range": [3, 7], "think_time_s": 0.5}))
    forward = [w.spec(i) for i in range(30)]
    again = build_workload(
        profile({"user_len_range": [4, 9], "output_len_range": [3, 7], "think_time_s": 0.5})
    )
    assert [again.spec(i) for i in reversed(range(30))][::-1] == forward  # any order, any process
    for s in forward:
        assert (s.session, s.turn) == (s.index // 3, s.index % 3 + 1)
        first = s.turn == 1
        assert s.system_len == (64 if first else 0) and s.think_time_s == (0.0 if first else 0.5)
        assert 4 <= s.input_len - s.system_len <= 9 and 3 <= s.max_new_tokens <= 7
        assert s.prefix_group == 0 and s.ignore_eos
    firsts = [s for s in forward if s.turn == 1]
    system = firsts[0].input_ids[:64]
    assert all(s.input_ids[:64] == system for s in firsts)  # one system prompt, shared by every session
    assert len({s.input_ids[64:66] for s in firsts}) == len(firsts)  # then each session its own


def test_system_prompts_are_per_group_and_share_nothing_between_groups():
    w = build_workload(profile({"num_system_prompts": 4}))
    firsts = [w.spec(3 * s) for s in range(8)]
    assert [s.prefix_group for s in firsts] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert firsts[0].input_ids[:64] == firsts[4].input_ids[:64]
    assert len({s.input_ids[0] for s in firsts[:4]}) == 4
    assert build_workload(profile({"system_prompt_len": 0})).spec(0).prefix_group is None


@pytest.mark.parametrize(
    "workload",
    [{"num_system_prompts": 3}, {"user_len_range": [4, 9], "output_len_range": [3, 3], "turns": 4}],
)
def test_the_cache_hit_bound_is_each_turns_history_from_the_specs(workload):
    """The bound (computed in bulk) against its definition from the specs themselves: a turn whose previous
    turn is among the indices shares that turn's prompt and reply but its last token; else the system prompt
    with an earlier request of the same one. For a run's order and for subsets with gaps."""
    w = build_workload(profile(workload))
    turns = w.turns
    specs = {i: w.spec(i) for i in range(600)}

    def prompt_len(i):  # the history's length at request i: every turn's own part and every earlier reply
        first = i - i % turns
        return sum(specs[j].input_len for j in range(first, i + 1)) + sum(
            specs[j].max_new_tokens for j in range(first, i)
        )

    for indices in (
        list(range(600)),
        [i for i in range(600) if i % 5],
        sorted(np.random.default_rng(4).choice(600, 150, replace=False).tolist()),
    ):
        present, groups, truth = set(indices), set(), []
        for i in indices:
            group = specs[i].prefix_group
            if i % turns and i - 1 in present:
                shared = prompt_len(i - 1) + specs[i - 1].max_new_tokens - 1
            else:
                shared = 64 if group in groups else 0
            truth.append(min(shared, prompt_len(i) - 1))
            groups.add(group)
        assert w.reusable_prefix(indices).tolist() == truth


# ---------------------------------------------------------------- the wire


def test_each_api_sends_the_history_and_the_replies_that_came_back():
    w = build_workload(profile())
    renderer = get_renderer(None)
    specs = [w.spec(i) for i in range(3)]
    user = [renderer.text(s.input_ids[s.system_len :]) for s in specs]

    native = Dialogue("generate", renderer)
    first = native.prompt(specs[0])
    assert (
        first.fields == {"input_ids": [TOKEN_ID_BASE + t for t in specs[0].input_ids]}
        and first.input_len == 80
    )
    native.reply([7, 8, 9], 3)
    second = native.prompt(specs[1])
    assert second.fields["input_ids"] == first.fields["input_ids"] + [7, 8, 9] + renderer.token_ids(
        specs[1].input_ids
    )
    assert second.input_len == 80 + 3 + 16 == len(second.fields["input_ids"])
    # A turn that got no reply (it failed) adds nothing: the next one follows its prompt directly.
    third = native.prompt(specs[2])
    assert third.fields["input_ids"] == second.fields["input_ids"] + renderer.token_ids(specs[2].input_ids)

    text = Dialogue("completions", renderer)
    assert text.prompt(specs[0]).fields == {"prompt": renderer.text(specs[0].input_ids)}
    text.reply(" the model answers", 3)
    assert (
        text.prompt(specs[1]).fields["prompt"]
        == f"{renderer.text(specs[0].input_ids)} the model answers {user[1]}"
    )

    chat = Dialogue("chat", renderer)
    assert chat.prompt(specs[0]).fields["messages"] == [
        {"role": "system", "content": renderer.text(specs[0].input_ids[:64])},
        {"role": "user", "content": user[0]},
    ]
    chat.reply(" the model answers", 3)
    turn2 = chat.prompt(specs[1])
    assert turn2.fields["messages"][2:] == [
        {"role": "assistant", "content": " the model answers"},
        {"role": "user", "content": user[1]},
    ]
    assert turn2.input_len == 80 + 3 + 16


# ---------------------------------------------------------------- tickets


def test_tickets_hand_out_whole_sessions_and_count_requests():
    t = Tickets(warmup=6, measured=8, turns=3)
    got = [t.take_ready(0.0) for _ in range(3)]
    assert [(x.index, x.phase, x.turns) for x in got[:2]] == [(0, WARMUP, 3), (3, WARMUP, 3)]
    assert got[2] is None  # the barrier: measured sessions wait for every warm-up request
    for _ in range(5):
        assert not t.finished(WARMUP)
    assert t.finished(WARMUP)  # the sixth warm-up request opens it
    rest = [t.take_ready(1.0) for _ in range(4)]
    assert [(x.index, x.phase, x.turns) for x in rest[:3]] == [
        (6, MEASURE, 3),
        (9, MEASURE, 3),
        (12, MEASURE, 2),
    ]
    assert rest[3] is None and t.exhausted  # the last session is cut at the end of its phase
    for _ in range(8):
        t.finished(MEASURE)
    assert t.done


# ---------------------------------------------------------------- the profile


WORKLOAD_YAML = "workload: {kind: conversation, turns: 3, user_len: %s}\n"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("requests:\n  warmup: 5\n", ":3: requests.warmup: 5 warm-up requests are not whole sessions of "
                                      "workload.turns 3 (a session's turns share one phase): use a multiple of 3, "
                                      "e.g. 3 or 6"),
        ("classes:\n  - {name: a, share: 1}\n", ":2: classes: not with a conversation workload"),
        ("", ":1: workload: user_len must be at least 2"),
    ],
)  # fmt: skip
def test_bad_conversation_profiles_get_one_line(tmp_path, text, fragment):
    path = tmp_path / "p.yaml"
    path.write_text(WORKLOAD_YAML % (1 if not text else 16) + text)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert f"{path}{fragment}" in str(info.value) and "\n" not in str(info.value)


def test_a_class_cannot_be_a_conversation_and_input_len_names_the_keys(tmp_path):
    rp = {"kind": "random_prefix", "input_len": 8, "output_len": 4}
    with pytest.raises(ProfileError, match=r"classes\.0\.workload\.kind: not conversation"):
        validate_profile({"workload": rp, "classes": [{"name": "a", "share": 1, "workload": CONV}]})
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"workload": CONV}))
    with pytest.raises(ProfileError, match="user_len"):
        load_profile(path, {"workload.input_len": 100})


# ---------------------------------------------------------------- virtual time


def by_turn(records) -> dict[int, float]:
    """The cache-hit ratio of each turn's completed measured requests."""
    out = {}
    for t in sorted({r.turn for r in records}):
        mine = [r for r in records if r.turn == t and r.phase == MEASURE and r.outcome == "ok"]
        out[t] = sum(r.cached_tokens for r in mine) / sum(r.prompt_tokens for r in mine)
    return out


def test_virtual_time_the_cache_hit_ratio_rises_by_turn_and_sessions_stay_closed_loops(tmp_path):
    p = profile({"think_time_s": 0.25}, load={"concurrency": 4}, requests={"warmup": 3, "measured": 60})
    run_dir = run_virtual(p, {"gpu": "h100-80gb"}, tmp_path, "conv")
    records = sorted(load_records(run_dir).itertuples(), key=lambda r: r.index)
    ratios = by_turn(records)
    assert ratios[1] < ratios[2] < ratios[3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sessions"] == 20 and [t["turn"] for t in summary["turns"]] == [1, 2, 3]
    assert [t["cached_token_ratio"] for t in summary["turns"]] == pytest.approx(
        [ratios[1], ratios[2], ratios[3]]
    )
    assert summary["load_model"] == "closed loop, 4 sessions of 3 turns at a time"
    # A turn holds its session's history exactly: the previous prompt and reply are cached (all but the reply's
    # last token), and the workload's bound says so.
    for prev, r in zip(records, records[1:], strict=False):
        if r.turn > 1:
            assert r.input_len == prev.input_len + prev.output_tokens + 16 == r.prompt_tokens
            assert r.cached_tokens == prev.input_len + prev.output_tokens - 1
            # One user per session, each turn sent after the previous reply ended and the think time.
            assert r.user_id == prev.user_id
            assert r.t_send_wall - (prev.t_send_wall + prev.e2e_ms / 1000) == pytest.approx(0.25, abs=1e-5)
    assert summary["cached_token_ratio"] == pytest.approx(summary["expected_cached_token_ratio"], abs=0.02)
    assert not [f for f in summary["findings"] if f["kind"] in ("no_warmup", "load_not_locked")]


def test_virtual_time_open_loop_sessions_arrive_at_the_rate_and_the_cap_counts_sessions():
    p = profile({"think_time_s": 1.0}, load={"model": "open", "rate": 4, "arrival": "constant", "concurrency": 2},
                requests={"measured": 30})  # fmt: skip
    vr = simulate(p, {"gpu": "h100-80gb"})
    records = sorted(vr.records, key=lambda r: r.index)
    firsts = [r for r in records if r.turn == 1]
    assert np.allclose(np.diff([r.t_scheduled_wall for r in firsts]), 0.25)  # sessions due 0.25 s apart
    assert all(r.t_scheduled_wall is None for r in records if r.turn > 1)
    # At most 2 sessions at once (each holds its user for ~2 s of thinking): sessions start late.
    spans = [
        (r.t_send_wall, records[r.index + 2].t_send_wall + records[r.index + 2].e2e_ms / 1000) for r in firsts
    ]
    assert max(sum(a <= t < b for a, b in spans) for t, _ in spans) == 2
    assert firsts[-1].t_send_wall - firsts[-1].t_scheduled_wall > 5


# ---------------------------------------------------------------- real time (Locust against the twin)

RUN_PROFILE = """\
name: conv
seed: 5
target: {{url: embedded, api: {api}, embedded: {{gpu: h100-80gb, enable_cache_report: true}}}}
load: {{concurrency: 3}}
requests: {{warmup: 3, measured: 27}}
workload: {{kind: conversation, turns: 3, system_prompt_len: 128, user_len: 24, output_len: 16,
            think_time_s: 0.05}}
"""


def loadlab_run(tmp_path: Path, api: str, *extra: str) -> tuple[Path, Path]:
    import subprocess

    path = tmp_path / f"{api}.yaml"
    path.write_text(RUN_PROFILE.format(api=api))
    done = subprocess.run([*LOADLAB, "run", str(path), "--out", str(tmp_path), *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return path, Path(done.stdout.strip().splitlines()[-1])


def test_real_time_chat_sessions_against_the_twin_the_cache_hit_ratio_rises_by_turn(tmp_path):
    _, run_dir = loadlab_run(tmp_path, "chat")
    records = sorted(load_records(run_dir).itertuples(), key=lambda r: r.index)
    assert [r.index for r in records] == list(range(30)) and {r.outcome for r in records} == {"ok"}
    ratios = by_turn(records)
    assert ratios[1] < ratios[2] < ratios[3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [round(t["cached_token_ratio"], 6) for t in summary["turns"]] == [
        round(ratios[t], 6) for t in (1, 2, 3)
    ]
    for prev, r in zip(records, records[1:], strict=False):
        if r.turn > 1:  # the chat template's tokens aside, the history (and the reply but its last token) hit
            assert r.cached_tokens >= prev.prompt_tokens + prev.output_tokens - 1
            assert r.user_id == prev.user_id and r.t_send_wall >= prev.t_send_wall + prev.e2e_ms / 1000 + 0.05
    assert "## Per turn (9 measured sessions)" in (run_dir / "summary.md").read_text()


def test_two_workers_keep_each_session_on_one_user_and_match_virtual_time(tmp_path):
    path, run_dir = loadlab_run(tmp_path, "generate", "--workers", "2")
    records = sorted(load_records(run_dir).itertuples(), key=lambda r: r.index)
    assert [r.index for r in records] == list(range(30)) and {r.outcome for r in records} == {"ok"}
    assert len({r.worker_id for r in records}) == 2
    for s in range(10):
        turns = records[3 * s : 3 * s + 3]
        assert len({(r.worker_id, r.user_id) for r in turns}) == 1  # one user holds the whole session
        assert [r.turn for r in turns] == [1, 2, 3] and all(r.session == s for r in turns)
        assert all(
            a.t_send_wall + a.e2e_ms / 1000 < b.t_send_wall for a, b in zip(turns, turns[1:], strict=False)
        )
    # The twin generates as a function of the prompt, so the native API's turns are the virtual run's, token
    # for token: the same prompts (history and replies) and the same cache hits after the first turn.
    virtual = {r.index: r for r in simulate(load_profile(path), {"gpu": "h100-80gb"}).records}
    for r in records:
        v = virtual[r.index]
        assert (r.input_len, r.prompt_tokens, r.output_tokens) == (
            v.input_len,
            v.prompt_tokens,
            v.output_tokens,
        )
        if r.turn > 1:
            assert r.cached_tokens == v.cached_tokens
    ratios = by_turn(records)
    assert ratios[1] < ratios[2] < ratios[3]


def test_the_virtual_reply_is_the_twins_output_for_the_prompt():
    # What the virtual run feeds back is what the HTTP twin sends as output_ids for the same prompt.
    from loadlab.sim.server import _Output

    prompt = [TOKEN_ID_BASE + i for i in range(40)]
    assert output_ids_for(prompt, 9) == list(_Output(prompt, 9).ids)

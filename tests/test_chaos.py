"""Chaos in CI: SIGKILL each actor kind once during a tiny run (rollout, engine, buffer,
trainer, eval), through ``asyncrl.runtime.chaos``; the run stops once the last victim is
back, at the step it reached, and the audit finds no prompt lost, none trained twice, and
every consumed group in the trainer's own audit log."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.job import run_job
from asyncrl.runtime.chaos import Chaos, Kill, KillAt, audit_run, check_targets
from asyncrl.runtime.supervisor import Supervisor
from tests.test_train import LONG_RUN, eval_flags, job_flags, lines, write_prompts
from tests.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

# Each kill waits until the last victim is back (an engine or eval takes 10-15 s), and
# CI trains about 6 steps/s: the five kills took about 220 steps there, 80 of them while
# the eval actor came back. STEPS is only a ceiling: the chaos stops the trainer once the
# eval actor, killed last, is back (about step 140 here, where the run went on to 330).
STEPS = 330
KILLS = ["engine-1@step10", "rollout-0@step20", "buffer@step30", "trainer@step40", "eval@step50"]


def chaos_flags(tmp_path) -> list[str]:
    return [
        *job_flags(tmp_path, steps=STEPS), *LONG_RUN, "--num-epoch", "40",
        *eval_flags(tmp_path, 100),
        *["--rollout.num-actors", "2", "--rollout.engine.model-path", str(tmp_path / "model")],
        *["--rollout.engine.serve", "actor", "--update-weight-transport", "disk"],
        *["--save-interval", "5", "--train.keep-checkpoints", "2", "--train.audit-log", "true"],
        # No timed buffer checkpoint after the one at start: the killed buffer must come
        # back by replaying its journal (a timed one could land just before the kill).
        *["--runtime.buffer-checkpoint-interval", "3600"],
    ]  # fmt: skip


async def test_sigkill_of_each_actor_kind_loses_nothing_and_trains_each_group_once(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=64)
    chaos = Chaos([KillAt.parse(k) for k in KILLS], stop_when_back=True)
    result = await run_job(load_config(overrides=chaos_flags(tmp_path)), chaos=chaos)
    assert result.ok, result.error
    assert [k.actor for k in chaos.kills] == [k.split("@")[0] for k in KILLS]
    assert all(k.back_s is not None for k in chaos.kills), chaos.kills
    assert 50 < result.steps < STEPS  # stopped after the last kill, not run to the end
    restarted = sorted(r.split(":")[0] for r in result.restarts)
    # A killed engine also takes down its rollout actor's requests (EngineUnavailable),
    # which restarts that rollout actor too.
    assert {"buffer", "trainer", "eval", "rollout-0", "engine-1"} <= set(restarted), restarted
    audit = audit_run(tmp_path / "run", result.steps)
    assert audit.ok, audit.problems
    assert audit.final_version == result.steps == audit.batches_trained
    # Every step has its metrics row, the killed trainer's last ones included.
    steps = {json.loads(x)["step"] for x in lines(tmp_path / "run" / "metrics.jsonl")}
    assert steps == set(range(1, result.steps + 1)), sorted(set(range(1, result.steps + 1)) - steps)
    # Two groups a step; a batch taken while the trainer stopped is held, not trained.
    assert audit.consumed - audit.held == result.steps * 2
    assert audit.lost == 0 and audit.duplicated == 0
    # The restarted trainer resumed from its checkpoint and was served the batches after it.
    trainer_log = [json.loads(x) for x in lines(tmp_path / "run" / "logs" / "trainer.jsonl")]
    assert any(r["event"] == "trainer resumed" for r in trainer_log)
    buffer_log = [json.loads(x) for x in lines(tmp_path / "run" / "logs" / "buffer.jsonl")]
    restored = [r for r in buffer_log if r["event"] == "buffer restored"]
    assert restored and restored[0]["journal_records"] > 0, restored
    # Each engine actor served its rollout actor and took the weights over HTTP from disk.
    for engine in ("engine-0", "engine-1"):
        log = [json.loads(x) for x in lines(tmp_path / "run" / "logs" / f"{engine}.jsonl")]
        assert any(r["event"] == "engine serving" for r in log), engine
        assert any(r["event"] == "weights updated" for r in log), engine


#: A signal to an actor that the controller did not send is a fault, whatever the kind:
#: SIGTERM drains it and it is restarted; SIGSTOP silences it, and it is killed as hung.
#: tests/test_controller_faults.py sends SIGTERM to the trainer, the buffer and a rollout
#: actor, and SIGSTOP to the buffer at the stop; here the engine and the eval actor get
#: SIGTERM, and SIGSTOP goes to an engine and to the trainer (whose restart resumes a
#: checkpoint). A hung actor is then SIGKILLed, whose restart per kind is the test above.
SIGNALLED = ["engine-1@step10:SIGSTOP", "trainer@step20:SIGSTOP", "eval@step25:SIGTERM",
             "engine-0@step30:SIGTERM"]  # fmt: skip


async def test_sigterm_and_sigstop_of_each_actor_kind_are_faults_that_lose_nothing(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=64)
    chaos = Chaos([KillAt.parse(k) for k in SIGNALLED], stop_when_back=True)
    # Four signals, each after the last victim is back: a higher ceiling than STEPS.
    # Heartbeats every 0.5 s: ten missed ones are a hang (set-up has the startup timeout).
    flags = [*chaos_flags(tmp_path), "--runtime.heartbeat-timeout", "5"]
    flags += ["--train.num-steps", "3000"]
    result = await run_job(load_config(overrides=flags), chaos=chaos)
    assert result.ok, result.error
    sent = [f"{k.actor}:{k.signal}" for k in chaos.kills]
    assert sent == [f"{k.split('@')[0]}:{k.split(':')[1]}" for k in SIGNALLED]
    assert all(k.back_s is not None for k in chaos.kills), chaos.kills
    # Each victim was restarted, none counted as finished: SIGTERM by its own word,
    # SIGSTOP by the silence that followed.
    causes = "\n".join(result.restarts)
    for kill in chaos.kills:
        why = "stopped by SIGTERM" if kill.signal == "SIGTERM" else "no heartbeat"
        assert f"{kill.actor}: " in causes and why in causes, (kill, causes)
    assert sum("stopped by SIGTERM, which the controller did not send" in r
               for r in result.restarts) >= 2, causes  # fmt: skip
    audit = audit_run(tmp_path / "run", result.steps)
    assert audit.ok, audit.problems
    assert audit.lost == 0 and audit.duplicated == 0
    assert audit.consumed - audit.held == result.steps * 2


def test_asyncrl_chaos_refuses_a_bad_kill_before_launch(tmp_path, capsys):
    assert main(["chaos", "--kill", "trainer@soon", *chaos_flags(tmp_path)]) == 2
    assert "expected TARGET@SECONDSs or TARGET@stepN" in capsys.readouterr().err
    flags = ["--kill", "trainer@step5", "--every", "10", "--stop-when-back"]
    assert main(["chaos", *flags, *chaos_flags(tmp_path)]) == 2
    assert "--stop-when-back ends it after the --kill list" in capsys.readouterr().err
    with pytest.raises(ValueError, match="give one"):
        Chaos([KillAt.parse("trainer@step5")], every=10.0, stop_when_back=True)


def write_run(run_dir, buffer_row: dict, trained: list[dict], final: int) -> None:
    """A finished run's files as the audit reads them."""
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "metrics" / "buffer.jsonl").write_text(json.dumps(buffer_row) + "\n")
    (run_dir / "trained.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trained))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": final}) + "\n")


def test_the_audit_finds_lost_repeated_and_untrained_groups(tmp_path):
    row = {"buffer.admitted": 7, "buffer.consumed": 6, "buffer.buffered": 1,
           "buffer.filtered.stale": 0, "buffer.unacked_groups": 2,
           "buffer.unacked_batch_ids": [3]}  # fmt: skip
    trained = [
        {"batch": 1, "groups": ["a", "b"], "trained": True},
        {"batch": 2, "groups": ["c", "d"], "trained": True},
        {"batch": 2, "groups": ["c", "d"], "trained": True},  # retrained after a restart
    ]
    write_run(tmp_path / "ok", row, trained, final=2)  # batch 3 (e, f): held, not trained
    audit = audit_run(tmp_path / "ok", 2)
    assert audit.ok, audit.problems
    assert (audit.lost, audit.duplicated, audit.untrained, audit.held) == (0, 0, 0, 2)

    bad = [*trained, {"batch": 4, "groups": ["a", "x"], "trained": True}]
    write_run(tmp_path / "bad", {**row, "buffer.admitted": 9}, bad, final=2)
    audit = audit_run(tmp_path / "bad", 3)
    assert audit.lost == 2 and audit.duplicated == 1  # "a" in batches 1 and 4
    assert "the final version is 2, not 3" in audit.problems
    assert "3 batches made a version, yet it is 2" in audit.problems


def test_chaos_kills_name_an_actor_or_role_that_is_restarted():
    roles = {"buffer": "buffer", "trainer": "trainer", "rollout-0": "rollout"}
    budgets = {"buffer": 3, "trainer": 0, "rollout": 3}
    check_targets([KillAt.parse("rollout@step3"), KillAt.parse("random@9s")], roles, budgets)
    with pytest.raises(ValueError, match="'eval': not an actor or role of this job"):
        check_targets([KillAt.parse("eval@1s")], roles, budgets)
    with pytest.raises(ValueError, match=r"trainer actors are not restarted.*--save-interval"):
        check_targets([KillAt.parse("trainer@step5")], roles, budgets)
    assert KillAt.parse("rollout-1@2.5s") == KillAt("rollout-1", seconds=2.5)
    assert KillAt.parse("buffer@step4:term") == KillAt("buffer", step=4, signal="SIGTERM")
    assert KillAt.parse("buffer@1s:SIGSTOP").signal == "SIGSTOP"
    with pytest.raises(ValueError, match="'HUP' is not one of SIGKILL"):
        KillAt.parse("buffer@1s:HUP")
    with pytest.raises(ValueError, match="SIGTERM needs the local runtime"):
        check_targets([KillAt.parse("rollout@1s:TERM")], roles, budgets, runtime="ray")
    assert Chaos([KillAt("a", step=9), KillAt("b", seconds=3), KillAt("c", step=2)]).schedule == [
        KillAt("b", seconds=3),
        KillAt("c", step=2),
        KillAt("a", step=9),
    ]


class KillEvalAfterTheTrainer(Chaos):
    """SIGKILLs the eval actor in its final evaluation, after the trainer has exited: the
    restarted eval actor can hear no announcement and must be pointed at the checkpoint."""

    async def run(self, sup: Supervisor) -> None:
        await sup.wait_until(lambda _: sup.up)
        await sup.wait_until(lambda st: st["trainer"].state == "finished")
        handle, st = sup.handles["eval"], sup.status["eval"]
        self.killed_while = st.state
        self.kills.append(Kill("eval", handle.pid, 0.0, st.version))
        sup.runtime.kill(handle)
        await self._watch_back(sup)


async def test_an_eval_actor_killed_after_the_trainer_exited_evaluates_the_final_checkpoint(
    tmp_path,
):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=64)
    # One long final evaluation (64 prompts x 16 samples, about 8 s here), so the kill
    # lands inside it (the trainer takes 1-2 s from its last step to its exit).
    sets = [{"name": "held", "path": str(tmp_path / "prompts.jsonl@[0:64]"), "n_samples": 16,
             "pass_k": [1], "sampling": {"temperature": 1.0, "max_new_tokens": 32}}]  # fmt: skip
    flags = [*job_flags(tmp_path, steps=4), "--eval-interval", "1000", "--eval.at-start", "false",
             "--eval.sets", json.dumps(sets)]  # fmt: skip
    chaos = KillEvalAfterTheTrainer([])
    result = await run_job(load_config(overrides=flags), chaos=chaos)
    assert result.ok, result.error
    # Killed before it evaluated the final version (starting, or in the evaluation).
    assert chaos.killed_while in ("starting", "running"), chaos.killed_while
    assert chaos.kills[0].back_s is not None, chaos.kills
    assert any(r.startswith("eval") for r in result.restarts), result.restarts
    run_dir = tmp_path / "run"
    evals = [json.loads(x) for x in lines(run_dir / "metrics" / "eval.jsonl")]
    assert [r["version"] for r in evals] == [4], evals
    eval_log = [json.loads(x) for x in lines(run_dir / "logs" / "eval.jsonl")]
    final = [r for r in eval_log if r["event"] == "evaluated the final version"]
    assert [r["pid"] for r in final] != [chaos.kills[0].pid] and len(final) == 1, final


class KillGroupMembers(Chaos):
    """The dist transport's group under kills: once every rollout actor has taken a version
    by broadcast, SIGKILL rollout-1 and wait until its successor takes one by broadcast
    (the group re-formed with it); then SIGKILL the trainer and wait until both rollout
    actors take one from its successor (re-formed again); then stop the run."""

    async def run(self, sup: Supervisor) -> None:
        await sup.wait_until(lambda _: sup.up)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch_back(sup), name="chaos.back")  # until the job ends
            await self._broadcasts(sup, {"rollout-0": 1, "rollout-1": 1})
            for victim in ("rollout-1", "trainer"):
                await self._kill(sup, victim)
                await sup.wait_until(lambda _: self.kills[-1].back_s is not None)
                # Counts from now on are by the group formed after the kill.
                counts = {r: self._count(sup, r) for r in ("rollout-0", "rollout-1")}
                await self._broadcasts(sup, {r: n + 1 for r, n in counts.items()})
            await self._stop_trainer(sup, "the group re-formed after each kill")

    @staticmethod
    def _count(sup: Supervisor, actor: str) -> int:
        return int(sup.status[actor].stats.get("rollout/weights_broadcast", 0))

    async def _broadcasts(self, sup: Supervisor, at_least: dict[str, int]) -> None:
        await sup.wait_until(lambda _: all(self._count(sup, a) >= n for a, n in at_least.items()))


async def test_the_dist_group_re_forms_after_a_member_and_the_trainer_are_killed(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=64)
    flags = [
        *job_flags(tmp_path, steps=STEPS), *LONG_RUN, "--num-epoch", "40",
        *["--rollout.num-actors", "2", "--update-weight-transport", "dist"],
        *["--save-interval", "5", "--train.audit-log", "true"],
    ]  # fmt: skip
    chaos = KillGroupMembers([])
    result = await asyncio.wait_for(run_job(load_config(overrides=flags), chaos=chaos), 300)
    assert result.ok, result.error
    assert [k.actor for k in chaos.kills] == ["rollout-1", "trainer"], chaos.kills
    assert result.steps < STEPS  # stopped by the chaos: the group re-formed twice
    audit = audit_run(tmp_path / "run", result.steps)
    assert audit.ok and audit.lost == 0 and audit.duplicated == 0, audit.problems
    # Rank 0 formed a group three times: at the start, after the member was lost, and the
    # restarted trainer (a new incarnation, so a new id) once more.
    trainer_log = [json.loads(x) for x in lines(tmp_path / "run" / "logs" / "trainer.jsonl")]
    formed = [r["group"] for r in trainer_log if r["event"] == "weight group formed"]
    assert len(set(formed)) == len(formed) >= 3, formed
    assert len({g.rpartition("-")[0] for g in formed}) == 2, formed  # two trainer processes
    failed = [r for r in trainer_log if r["event"].startswith("weight broadcast failed")]
    assert failed and "rank" in failed[0], failed  # the lost member's broadcast, logged

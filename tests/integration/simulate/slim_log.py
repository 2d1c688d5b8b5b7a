"""Makes the control-plane replay's test log from a recorded main-job log (how data/agent_rl_4steps.glog was made):

    python tests/integration/simulate/slim_log.py REPORT/events.glog tests/integration/simulate/data/agent_rl_4steps.glog

Keeps the message types the replay reads (simulate/counterfactual.py, simulate/recorded.py), every record as it was
(time, envelope, counts, times), but with token ids zeroed and per-token arrays the replay never reads emptied
(log-probs, versions, masks), granted micro-steps without their samples (their tokens are in MicroStepDone), and
a cell's LoadReport only when its role or capacity changes (the replay reads the largest capacity): a 1.7 MB log
becomes ~100 KB and replays to the same figures.
"""

from __future__ import annotations

import sys

import attrs

from gyre.runtime.codec import Codec
from gyre.runtime.event_log import EventLogWriter, read_log

KEEP = {
    "gyre.runtime.ActorStarted", "gyre.cells.RoleChanged", "gyre.model_calls.ModelCallCompleted",
    "gyre.training.ClaimGranted", "gyre.training.MicroStepDone", "gyre.training.StepReady",
    "gyre.training.StepApplied", "gyre.training.WeightsLoaded", "gyre.training.WeightsPublished",
    "gyre.cells.LoadReport", "gyre.executions.IssueKey", "gyre.executions.ExecutionStarted",
    "gyre.samples.ExecutionScored", "gyre.samples.ExecutionDropped", "gyre.samples.SamplesLanded",
    "gyre.execution_reports.AgentExited", "gyre.cells.SwitchRole",
}


def _slim(msg):
    name = type(msg).__name__
    if name == "ModelCallCompleted":
        return attrs.evolve(msg, new_prompt_ids=(), prompt_digest=b"", output_ids=(0,) * len(msg.output_ids),
                            output_logprobs=(), output_versions=())
    if name == "ClaimGranted":
        return attrs.evolve(msg, samples=())
    if name == "SamplesLanded":
        samples = tuple(attrs.evolve(s, token_ids=(0,) * len(s.token_ids), loss_mask=(), behaviour_logprobs=(),
                                     sampling_temperatures=(), advantages=(), weights=()) for s in msg.samples)
        return attrs.evolve(msg, samples=samples)
    return msg


def slim_log(source: str, target: str) -> int:
    codec = Codec()
    writer = EventLogWriter(target)
    reported: set[tuple[str, str, int]] = set()
    for record in read_log(source, codec):
        if record.type_name not in KEEP:
            continue
        if record.type_name == "gyre.cells.LoadReport":
            msg = record.decode(codec)
            key = (msg.cell, msg.role, msg.capacity_requests)
            if key in reported:
                continue
            reported.add(key)
        if record.type_name in ("gyre.runtime.ActorStarted",):
            writer.append(record.handled_s, record.header, record.body)
            continue
        writer.append(record.handled_s, *codec.encode(record.envelope, _slim(record.decode(codec))))
    writer.close()
    return writer.records_written


if __name__ == "__main__":
    print(slim_log(sys.argv[1], sys.argv[2]), "records")

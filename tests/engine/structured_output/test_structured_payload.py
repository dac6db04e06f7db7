"""Tensor-parallel workers get a structured-output request's params (they decide the LM
head's path from them, as the driver does) but never the bitmask: only the driver samples."""

from __future__ import annotations

from engine.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.worker.step_payload import decode_step, encode_step


def test_params_travel_and_the_bitmask_does_not():
    forms = [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"enum": [1, 2]}}}),
        StructuredOutputsParams(json='{"type": "string"}'),
        StructuredOutputsParams(regex="[0-9]+"),
        StructuredOutputsParams(choice=["a", "b"]),
        StructuredOutputsParams(grammar='start: "x"'),
        StructuredOutputsParams(json_object=True),
    ]
    new = [
        NewRequestData(f"r{i}", [1, 2], SamplingParams(structured_outputs=so), [], 2)
        for i, so in enumerate(forms)
    ]
    so = SchedulerOutput(
        scheduled=[ScheduledRequest(n.request_id, 0, 2, [1], True, 1) for n in new],
        num_batched_tokens=2 * len(new),
        new_requests=new,
        grammar_bitmask=object(),  # whatever it is, it stays on the driver
    )
    decoded, _ = decode_step(encode_step(so, {}))
    assert decoded.grammar_bitmask is None
    got = [n.sampling_params.structured_outputs for n in decoded.new_requests]
    assert got == forms

"""Stop checks: whether the token a request just got ends it, and with which status."""

from __future__ import annotations

from engine.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set a finished status if the last token ends the request. EOS and stop token ids
    win over length; neither counts before min_tokens. A completed grammar (structured
    output) stops too: nothing more could be generated; a failed one ends with an error."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        last = request.output_token_ids[-1]
        if last == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if request.grammar is not None and request.grammar.is_terminated():
        # A grammar in error (only a token outside its mask or a limit hit mid-way gets it
        # there) cannot vouch for the output: "error", not "stop".
        failed = request.grammar.failed()
        request.status = RequestStatus.FINISHED_ERROR if failed else RequestStatus.FINISHED_STOPPED
        return True
    if reaches_length(request, max_model_len):
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def reaches_length(request: Request, max_model_len: int, pending: int = 0) -> bool:
    """Whether the request has its last token by length: max_tokens outputs, or the context
    full. pending: tokens sampled but not yet seen (async scheduling's placeholders)."""
    max_tokens = request.sampling_params.max_tokens
    num_output = len(request.output_token_ids) + pending
    return (max_tokens is not None and num_output >= max_tokens) or (
        len(request.all_token_ids) + pending >= max_model_len
    )

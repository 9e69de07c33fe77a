"""The contract every engine implements and every face calls: the ``Engine`` base class (its
template method: a backend writes ``_stream``, everything a user calls is derived, chat included),
its lifetime (load, close, the guard that refuses a closed engine), the run loop that folds a
stream (stop strings, max tokens, usage, timings), the checks every engine makes the same way, the
logprob math, the step worker batching engines run on, and the ``Facts`` an engine is told.

Below it: the vocabulary, chat templates, model inspection, the machine and the planner; above it:
selection, the kit (``unillm.backend``), the engines and the faces.
"""

"""``make soak``: vLLM's OpenAI server (``moonep-ep serve``) under vLLM's own load client for a bounded time,
faults injected, resources sampled, answers checked (issue 39). ``python -m checks.soak`` (``__main__``: the
arguments) from the repository root, in the CPU engine's environment.

``run`` is the timeline and wires the rest to the ``server`` it drives. The parts that need no running engine:
``sampler`` reads what the OS says a server's process tree holds; ``server_metrics`` reads what the server
says it served (vLLM's Prometheus ``/metrics``, per interval); ``faults`` is the catalogue of bad requests and
client hang-ups with the seeded times they are injected at; ``bench_client`` builds the ``vllm bench serve``
command and reads its result JSON per window; ``verdicts`` judges the sampled series; ``plot`` draws them;
``shm`` names who holds ``/dev/shm`` entries. Each is pure over its inputs (the sampler reads ``/proc``, the
senders open sockets).
"""

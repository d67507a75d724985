"""The parts of ``make soak`` that need no running engine (issue 39).

``sampler`` reads what the OS says a server's process tree holds; ``faults`` is the catalogue of bad
requests and client hang-ups with the seeded times they are injected at; ``bench_client`` builds the
``vllm bench serve`` command and reads its result JSON per window; ``verdicts`` judges the sampled series;
``plot`` draws them. Each is pure over its inputs (the sampler reads ``/proc``, the senders open sockets);
whoever runs the soak wires them to the server.
"""

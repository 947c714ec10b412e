"""DeepSpeed's read API of the comms logger (``get_raw_data``, ``get_operation_summary``, ...) over our records
and over entries written in DeepSpeed's ``[count, latencies, algbws, busbws]`` form."""

from __future__ import annotations

import pytest

from deepspeed.utils.comms_logging import CommsLogger


def test_the_read_api_over_recorded_calls():
    logger = CommsLogger()
    assert not logger.has_data() and logger.get_operation_summary("all_reduce") is None
    for latency in (4.0, 1.0, 2.0, 3.0):
        logger.append("all_reduce", "all_reduce", latency, 1024, 2)
    logger.append("broadcast", "broadcast", 1.0, 64, 2)
    assert logger.has_data() and logger.get_total_operations() == 5
    assert sorted(logger.get_operation_names()) == ["all_reduce", "broadcast"]
    raw = logger.get_raw_data()["all_reduce"][1024]
    assert raw[0] == 4 and raw[1] == [4.0, 1.0, 2.0, 3.0]  # in call order
    summary = logger.get_operation_summary("all_reduce")[1024]
    assert summary["count"] == 4 and summary["total_latency_ms"] == 10.0 and summary["avg_latency_ms"] == 2.5
    assert summary["msg_size_str"] == "1.0 KB"
    logger.reset_data()
    assert not logger.has_data()


def test_summaries_keep_deepspeed_form_entries_in_order():
    logger = CommsLogger()
    latencies = [3.0, 1.0, 2.0]
    logger.comms_dict = {"all_reduce": {1024: [3, list(latencies), [10 / x for x in latencies], [1.0] * 3]}}
    assert logger.get_operation_summary("all_reduce")[1024]["avg_latency_ms"] == pytest.approx(2.0)
    assert logger.get_raw_data()["all_reduce"][1024][1] == latencies
    assert "all_reduce" in logger.summary_table()

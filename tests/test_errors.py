"""OpenAI-style error bodies (``prefix_router/errors.py``): the four fields vLLM and the OpenAI API
send, the status as the code, the status's usual type name."""

from __future__ import annotations

import json

from prefix_router.errors import error_body, openai_error, response_not_found


def test_the_body_has_four_fields_with_the_status_as_code_and_its_usual_type():
    assert error_body(404, "no such model", "model") == {
        "error": {"message": "no such model", "type": "NotFoundError", "param": "model", "code": 404}}
    assert error_body(418, "odd")["error"]["type"] == "Error"  # a status without a usual name
    assert error_body(400, "bad", type_="ContextLengthError")["error"]["type"] == "ContextLengthError"


def test_a_response_carries_the_body_its_status_and_the_headers_given():
    resp = openai_error(429, "busy", headers={"Retry-After": "1"})
    assert (resp.status, resp.content_type, resp.headers["Retry-After"]) == (429, "application/json", "1")
    assert json.loads(resp.body) == error_body(429, "busy")


def test_a_stored_response_not_found_is_vllms_404_naming_the_id_cut_short():
    rid = "resp_" + "x" * 500
    resp = response_not_found(rid, "previous_response_id")
    error = json.loads(resp.body)["error"]
    assert resp.status == 404 and error["param"] == "previous_response_id" and error["type"] == "NotFoundError"
    assert error["message"] == f"Response with id '{rid[:200]}' not found."

"""Tool calling's engine side in the vLLM adapter, against the real vLLM: a
chat request's tools and tool messages reach the model's chat template.
(The calls themselves are the front door's: supervisor/openai/tools.go.)"""

from __future__ import annotations


def test_tools_reach_the_chat_template_through_vllms_tokenizer(tmp_path):
    """A chat request's tools and tool messages, as the front door sends them
    (tools_json, tool_calls_json, tool_call_id, name), reach the model's chat
    template through vLLM's tokenizer: the same prompt as Hugging Face's
    apply_chat_template(conversation, tools=…) on that tokenizer (what vLLM's
    renderer calls for `vllm serve`) and as the reference engine's ChatML."""
    import json

    from frmps_engine import modeldir
    from frmps_engine._proto.frmps.v1 import control_pb2
    from frmps_engine.refengine import load_tokenizer
    from frmps_engine.sdk.genapi import chat_to_ids
    from frmps_engine.vllm.engine import VllmAdapter, VllmEngineConfig

    d = modeldir.write("qwen2.5-0.5b", str(tmp_path / "q05"))
    tok = VllmAdapter(VllmEngineConfig(model=d, num_blocks=64, max_model_len=4096)).tokenizer()
    tools_json = ('[{"type":"function","function":{"name":"get_weather","description":"Weather.","parameters":'
                  '{"type":"object","properties":{"city":{"type":"string"}}}}}]')
    msgs = [control_pb2.ChatMessage(role="user", content="Weather in Paris?"),
            control_pb2.ChatMessage(role="assistant", tool_calls_json='[{"id":"c1","type":"function","function":'
                                    '{"name":"get_weather","arguments":{"city":"Paris"}}}]'),
            control_pb2.ChatMessage(role="tool", tool_call_id="c1", content="21 C")]
    ids = chat_to_ids(tok, msgs, True, tools_json)
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": json.loads(msgs[1].tool_calls_json)},
            {"role": "tool", "content": "21 C", "tool_call_id": "c1"}]
    want = tok._tok.apply_chat_template(conv, tools=json.loads(tools_json), add_generation_prompt=True, tokenize=True)
    assert ids == list(want["input_ids"] if hasattr(want, "keys") else want)
    assert ids == load_tokenizer(d).apply_chat_template(conv, True, tools=json.loads(tools_json))
    text = tok.decode(ids)
    assert '"name": "get_weather", "description": "Weather."' in text and "<tool_response>\n21 C" in text
    assert ids != chat_to_ids(tok, msgs, True)  # without tools the template lists none

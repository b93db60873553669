"""Prompt analysis: from a request body to the token blocks, keys and message hashes routing needs.

``analysis`` cuts a prompt into blocks; ``tokenizer`` and ``chat_template`` render chat exactly as
vLLM does; ``responses`` and ``anthropic`` read the OpenAI Responses and Anthropic Messages APIs
as the chat vLLM renders from them.
"""

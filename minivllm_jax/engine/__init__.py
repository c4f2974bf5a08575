"""The engine floor: the loop (`llm_engine.LLMEngine`), admission, the output processor, detokenizing, prompts."""

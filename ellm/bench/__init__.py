"""`ellm bench`: measured memory bandwidth, eLLM vs llama.cpp at several context lengths, JSON and plots."""

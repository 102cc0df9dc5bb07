# Thin wrapper over CMake; the README's two commands are `make demo` and `make test`.
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=

.PHONY: all setup configure build test demo asan format format-check clean fuzz

all: build

setup:
	@./scripts/setup.sh

configure: setup
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

test: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

demo: build
	@./$(BUILD)/kvstage serve-demo

asan:
	@$(MAKE) --no-print-directory test BUILD=build-asan CMAKE_FLAGS="-DKVS_SANITIZE=ON -DKVS_CUDA=OFF"

# libFuzzer on the message codec, the GGUF reader, the OpenAI request parser and the tokenizer
# (needs clang and libclang-rt-14-dev), each for FUZZ_SECONDS; see fuzz/README.md. The seeds
# are copied into fuzz/out/, where the grown corpus and any crash inputs stay.
FUZZ_SECONDS ?= 30
FUZZ_TARGETS = codec gguf api tokenizer
FUZZ_CFLAGS = -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -Wall -Wextra -Wno-unused-parameter -D_POSIX_C_SOURCE=200809L -Iinclude -Isrc -Iserve -Itests
FUZZ_HTTP = serve/http/util.c serve/http/tokenize.c serve/model/tokenizer.c serve/model/sample.c \
  serve/model/unicode.c serve/model/gguf.c serve/model/quant.c src/base/*.c \
  $(shell pkg-config --libs jansson libmicrohttpd) -lpthread -lm
fuzz: setup
	@mkdir -p $(FUZZ_TARGETS:%=fuzz/out/corpus-%)
	clang $(FUZZ_CFLAGS) fuzz/fuzz_codec.c src/control/codec.c src/base/*.c -lpthread -lm \
	  -o fuzz/out/fuzz_codec
	clang $(FUZZ_CFLAGS) fuzz/fuzz_gguf.c serve/model/gguf.c serve/model/quant.c src/base/*.c \
	  -lpthread -lm -o fuzz/out/fuzz_gguf
	clang $(FUZZ_CFLAGS) fuzz/fuzz_api.c serve/http/api.c $(FUZZ_HTTP) -o fuzz/out/fuzz_api
	clang $(FUZZ_CFLAGS) fuzz/fuzz_tokenizer.c serve/model/model_path.c $(FUZZ_HTTP) \
	  -o fuzz/out/fuzz_tokenizer
	@for t in $(FUZZ_TARGETS); do cp fuzz/corpus/$$t/* fuzz/out/corpus-$$t/; done
	./fuzz/out/fuzz_codec -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	  -artifact_prefix=fuzz/out/ fuzz/out/corpus-codec
	./fuzz/out/fuzz_gguf -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	  -artifact_prefix=fuzz/out/ fuzz/out/corpus-gguf
	./fuzz/out/fuzz_api -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	  -dict=fuzz/api.dict -artifact_prefix=fuzz/out/ fuzz/out/corpus-api
	./fuzz/out/fuzz_tokenizer -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	  -artifact_prefix=fuzz/out/ fuzz/out/corpus-tokenizer

format:
	@git ls-files '*.c' '*.h' '*.cu' '*.cuh' | xargs -r clang-format -i

format-check:
	@git ls-files '*.c' '*.h' '*.cu' '*.cuh' | xargs -r clang-format --dry-run -Werror

clean:
	@rm -rf build build-asan

# Thin wrapper over CMake; the README's two commands are `make demo` and `make test`.
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=

.PHONY: all setup configure build test demo asan format format-check clean

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
	@./$(BUILD)/kvstage demo

asan:
	@$(MAKE) --no-print-directory test BUILD=build-asan CMAKE_FLAGS="-DKVS_SANITIZE=ON -DKVS_CUDA=OFF"

format:
	@git ls-files '*.c' '*.h' '*.cu' '*.cuh' | xargs -r clang-format -i

format-check:
	@git ls-files '*.c' '*.h' '*.cu' '*.cuh' | xargs -r clang-format --dry-run -Werror

clean:
	@rm -rf build build-asan

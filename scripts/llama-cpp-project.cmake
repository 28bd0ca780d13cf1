# Read by llama.cpp's own CMakeLists.txt right after its project() call (CMAKE_PROJECT_llama.cpp_INCLUDE, which
# scripts/setup-llama.sh passes): llama-cpp-python forces llama.cpp's `common` library on (with the HTTP client it
# downloads models through), but installs and loads only libllama and ggml's libraries. `common` and cpp-httplib were
# 52% of the compile (420 of 803 s of one Zen 3 core); nothing in llama_cpp or in this project uses them.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama.cpp's common library: not used by llama-cpp-python" FORCE)

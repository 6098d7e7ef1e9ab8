# Compile-check the Apple silicon variants (apple_m1, apple_m2) without a Mac:
# Debian's clang targeting aarch64 Linux with the table's -mcpu=apple-* flags,
# linked against the aarch64 cross GCC's runtime and run under qemu-aarch64.
# clang 14 knows -mcpu=apple-m1 but not apple-m2 (added in clang 15): for
# apple_m2 it uses the M2's architecture level, armv8.6-a with fp16, fp16fml,
# dotprod, bf16 and i8mm (the features the apple_m2 table entry requires).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CPUINFER_SYSROOT /usr/aarch64-linux-gnu CACHE PATH "Target runtime libraries for qemu -L")
set(CMAKE_C_COMPILER clang)
set(CMAKE_CXX_COMPILER clang++)
set(CMAKE_C_COMPILER_TARGET aarch64-linux-gnu)
set(CMAKE_CXX_COMPILER_TARGET aarch64-linux-gnu)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;-cpu;max;-L;${CPUINFER_SYSROOT})
set(CMAKE_FIND_ROOT_PATH ${CPUINFER_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CPUINFER_TARGET_PLATFORM arm64-apple CACHE STRING "")
execute_process(COMMAND clang++ --target=aarch64-linux-gnu -mcpu=apple-m2 -x c++ -fsyntax-only /dev/null
                RESULT_VARIABLE _m2_rc OUTPUT_QUIET ERROR_QUIET)
if(NOT _m2_rc EQUAL 0)
  # A plain variable, not a cache entry: a build directory configured with an older toolchain file
  # would otherwise keep its old flags (a cached value lacking +fp16fml built apple_m2's FMA tile).
  set(CPUINFER_FLAGS_OVERRIDE_apple_m2 "-march=armv8.6-a+fp16+fp16fml+dotprod+bf16+i8mm")
endif()

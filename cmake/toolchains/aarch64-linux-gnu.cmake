# Cross-compile for aarch64 Linux with Debian's cross GCC; ctest and
# try_run() run the results under qemu-user (`-cpu max`: every feature,
# including SVE, so every variant is exercised).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CPUINFER_SYSROOT /usr/aarch64-linux-gnu CACHE PATH "Target runtime libraries for qemu -L")
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;-cpu;max;-L;${CPUINFER_SYSROOT})
set(CMAKE_FIND_ROOT_PATH ${CPUINFER_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)

# Cross-compile for s390x (IBM Z) Linux with Debian's cross GCC; ctest and
# try_run() run the results under qemu-user (`-cpu max`: z15-class vector
# facilities, so vxe and vxe2 both run).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR s390x)
set(CPUINFER_SYSROOT /usr/s390x-linux-gnu CACHE PATH "Target runtime libraries for qemu -L")
set(CMAKE_C_COMPILER s390x-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER s390x-linux-gnu-g++)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-s390x;-cpu;max;-L;${CPUINFER_SYSROOT})
set(CMAKE_FIND_ROOT_PATH ${CPUINFER_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)

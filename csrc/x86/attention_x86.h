// x86 fast paths for paged attention (filled in below per ISA).
#pragma once

#pragma once
#include "nonstop/log.h"  // IWYU pragma: export

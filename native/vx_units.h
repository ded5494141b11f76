/* vx_units.h: the token unit every native token bucket counts in (vx_limits, and the lone
 * vx_bucket the benchmarks measure).
 *
 * 1 token = 60,000,000 units = the microseconds in a minute, so a rate of r tokens/min adds
 * exactly r units per microsecond: a refill is elapsed_us * rate, no division, no remainder
 * lost, no floating point.
 */
#ifndef VX_UNITS_H
#define VX_UNITS_H

#include <stdint.h>

#define VX_UNITS_PER_TOKEN INT64_C(60000000)

#endif

/* ABI check of kvwire's Rust mirror of <infiniband/verbs.h>.
 *
 * build.rs generates abi_items.h from native/abi_layout.txt: one
 * KV_SIZE(rust, ctype) and one KV_OFF(rust, ctype, field) line per entry.
 * This program prints "size <rust> <n>" and "off <rust> <field> <n>" for
 * each, as the system header lays them out; build.rs turns the output into
 * compile-time assertions on the Rust types. */
#include <stddef.h>
#include <stdio.h>
#include <infiniband/verbs.h>

#define KV_SIZE(rust, ctype) printf("size %s %zu\n", #rust, sizeof(ctype));
#define KV_OFF(rust, ctype, field) printf("off %s %s %zu\n", #rust, #field, offsetof(ctype, field));

int main(void)
{
#include "abi_items.h"
	return 0;
}

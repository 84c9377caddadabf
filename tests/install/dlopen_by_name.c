// dlopen-by-name: opens LIBRARY by name as NCCL opens its net plugin (dlopen, RTLD_NOW|RTLD_LOCAL:
// only the loader's own search, every symbol resolved), looks up SYMBOL and prints the path the
// library was loaded from. Exit 1 with dlerror()'s text when either fails.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: dlopen-by-name LIBRARY SYMBOL\n");
    return 2;
  }
  void* handle = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    fprintf(stderr, "dlopen(%s): %s\n", argv[1], dlerror());
    return 1;
  }
  if (!dlsym(handle, argv[2])) {
    fprintf(stderr, "dlsym(%s, %s): %s\n", argv[1], argv[2], dlerror());
    return 1;
  }
  struct link_map* map = NULL;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || !map) {
    fprintf(stderr, "dlinfo(%s): %s\n", argv[1], dlerror());
    return 1;
  }
  printf("%s\n", map->l_name);
  return 0;
}

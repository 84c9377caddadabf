# The Debian package (cpack -G DEB in the build folder): one package, ponte, with everything
# cmake --install puts in place, for prefix /usr (configure with -DCMAKE_INSTALL_PREFIX=/usr, which
# makes the library folder lib/<multiarch>, where NCCL's dlopen finds the plugin by name).
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME ponte)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR ponte)
set(CPACK_PACKAGE_CONTACT "ponte developers <ponte@ponte.invalid>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "RDMA transport for LLM systems: engine, NCCL net plugin (libnccl-net-ponte.so), tools")
set(CPACK_PACKAGE_DESCRIPTION
    "One RDMA engine over libibverbs (InfiniBand/RoCE) and libfabric (AWS EFA), the NCCL net plugin and the MoE collectives on it, ponte-bench, ponte-topo, ep-bench and fabric-ref, and the headers, CMake package and pkg-config files to build against libponte and libponte_collectives.")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION net)
# Linked libraries (libhwloc15, libstdc++6, libc6; libfabric1 for fabric-ref) come from
# dpkg-shlibdeps. libfabric and libibverbs are dlopen'ed by the engine, which dpkg-shlibdeps cannot
# see: declared here. Without a provider package, libibverbs finds no device.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "libfabric1, libibverbs1")
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "ibverbs-providers")
# A shlibs file for libponte, and ldconfig in postinst/postrm (CPack adds them for lib/ folders).
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
# cpack refuses a package whose library folder is not the multiarch one (see the top comment).
set(CPACK_PONTE_LIBDIR_PROBLEM "")
if(CMAKE_LIBRARY_ARCHITECTURE AND NOT CMAKE_INSTALL_LIBDIR STREQUAL "lib/${CMAKE_LIBRARY_ARCHITECTURE}")
  set(CPACK_PONTE_LIBDIR_PROBLEM
      "the library folder is ${CMAKE_INSTALL_LIBDIR}, not lib/${CMAKE_LIBRARY_ARCHITECTURE}: configure the build with -DCMAKE_INSTALL_PREFIX=/usr to package it")
endif()
set(CPACK_PROJECT_CONFIG_FILE ${CMAKE_CURRENT_LIST_DIR}/ponte_cpack_check.cmake)
include(CPack)

// Runs a TorchScript model whose forward calls torch.ops.circle.loss,
// anchor_loss and class_loss, with no Python at run time, and prints
// `loss <value>`; given an AOTInductor package of the same model exported
// with torch.export, runs that too and prints `aoti loss <value>`.
//
//   circle_loss_example <model.pt> <inputs.pt> [<model.pt2>]
//
// inputs.pt is a scripted module holding the tensors `features` and `labels`
// (TorchScript's container format, readable from C++ without Python).
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>

#include <iomanip>
#include <iostream>

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    std::cerr << "usage: " << argv[0] << " <model.pt> <inputs.pt> [<model.pt2>]\n";
    return 2;
  }
  try {
    // The circle ops are registered by libcircle_loss_ops, linked into this
    // program; loading the model fails with "unknown builtin op" otherwise.
    torch::jit::Module model = torch::jit::load(argv[1]);
    torch::jit::Module inputs = torch::jit::load(argv[2]);
    const at::Tensor features = inputs.attr("features").toTensor();
    const at::Tensor labels = inputs.attr("labels").toTensor();
    torch::NoGradGuard no_grad;
    const at::Tensor loss = model.forward({features, labels}).toTensor();
    std::cout << std::setprecision(10) << "loss " << loss.item<double>() << std::endl;
    if (argc == 4) {
      // The package calls the op through the dispatcher, so it too needs the
      // library loaded, which linking it has done.
      torch::inductor::AOTIModelPackageLoader package(argv[3]);
      const std::vector<at::Tensor> outputs = package.run({features, labels});
      std::cout << "aoti loss " << outputs.at(0).item<double>() << std::endl;
    }
  } catch (const c10::Error& error) {
    std::cerr << error.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
